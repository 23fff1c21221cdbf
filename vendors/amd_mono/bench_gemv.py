"""Time amd_mono's dense MLP GEMV stages alone (gate/up + SiLU, down + residual) over tile and launch options.

Usage (on the H200): PYTHONPATH=core/src:vendors/amd_mono/src python vendors/amd_mono/bench_gemv.py
    --model llama-3.2-1b --rows 1 --grid 132,264 --bn 16,32,64 --bk 128,256 --warps 4,8 --stages 3
    ... --rows 1 --row1 1,0 --grid 132 --bn 64 --bk 128 --warps 4    # the one-row FMA form against tl.dot

Each configuration launches K2 in the stage-per-launch mode for one stage (``STAGE`` 5 or 6: no waits), with the
given tile (``BN_*`` x ``BK_*``), ``num_warps``, ``num_stages`` and a grid of ``--grid`` programs looping over the
stage's items, over ``--layers`` distinct layers in a CUDA graph (more weight bytes than the L2), and prints the
median per launch against the stage's byte floor (its weight bytes at the copy bandwidth measured in the run).
It answers how fast the stage's inner loop streams weights, with no stage waits and no other stage in the kernel.
``--row1`` (one row only) times each configuration in the one-row FMA form (``ROW1`` 1, ``kernels/gemv_row1.py``)
and/or the ``tl.dot`` form (0); at one row the default is the production choice (``row1_fma``, off).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from bench_layers import LayerBench, copy_bandwidth, graph_median_us  # same directory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--grid", default="132,264", help="programs per launch (comma-separated)")
    ap.add_argument("--bn", default="16,32,64")
    ap.add_argument("--bk", default="128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--row1", default="", help="GEMV forms at one row: 1 the one-row FMA form, 0 tl.dot (e.g. 1,0)")
    ap.add_argument("--which", default="gate_up,down", help="stages to time (comma-separated: gate_up, down)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv.py needs a GPU", file=sys.stderr)
        return 2
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    bw = copy_bandwidth()
    lb = LayerBench(args.model, args.layers, args.rows, 512)
    fwd = lb.mono(amd_mono_staged=True)
    shape = fwd.plan.step_shape(args.rows, 1)
    forms = [bool(v) for v in ints(args.row1)] if args.row1 else [fwd.row1(args.rows)]
    if any(forms) and args.rows != 1:
        print("--row1 1 needs --rows 1 (the one-row form computes row 0 only)", file=sys.stderr)
        return 2
    c = lb.cfg
    launches = [fwd.k2_launch(i, lb.batch, shape) for i in range(c.num_hidden_layers)]
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s; {args.model}, {args.rows} rows; "
          f"production tiles gate/up {fwd.plan.gu}, down {fwd.plan.down}")
    print(f"{'stage':8s} {'row1':>4s} {'grid':>5s} {'BN':>4s} {'BK':>4s} {'warps':>5s} {'stages':>6s} {'us':>8s} "
          f"{'floor us':>8s} {'% floor':>7s}")
    which = set(args.which.split(","))
    if not which <= {"gate_up", "down"}:
        print(f"--which takes gate_up and/or down, got {args.which!r}", file=sys.stderr)
        return 2
    for stage, name, keys, nbytes in ((5, "gate_up", ("BN_GU", "BK_GU"), 2 * c.intermediate_size * c.hidden_size * 2),
                                      (6, "down", ("BN_D", "BK_D"), c.intermediate_size * c.hidden_size * 2)):
        if name not in which:
            continue
        floor = nbytes / bw * 1e6
        for row1, grid, bn, bk, warps, st in itertools.product(forms, ints(args.grid), ints(args.bn), ints(args.bk),
                                                               ints(args.warps), ints(args.stages)):
            def run(row1=row1, grid=grid, bn=bn, bk=bk, warps=warps, st=st, stage=stage, keys=keys) -> None:
                for _, kernel, _, a, meta in launches:
                    kernel[(grid,)](*a, **{**meta, keys[0]: bn, keys[1]: bk, "STAGE": stage, "ROW1": row1},
                                    num_warps=warps, num_stages=st)
            cfg = f"{name:8s} {int(row1):4d} {grid:5d} {bn:4d} {bk:4d} {warps:5d} {st:6d}"
            try:
                us = graph_median_us(run) / len(launches)
            except Exception as e:  # e.g. out of shared memory for a large tile; keep timing the others
                print(f"{cfg} not timed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"{cfg} {us:8.1f} {floor:8.1f} {100 * floor / us:6.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
