"""Launch plans measured per GPU model, with the heuristics of ``plan_gemm`` / ``plan_qkv`` /
``default_attn_plan`` as the fallback.

Like the per-device Triton config files of vLLM's and SGLang's fused MoE, the table holds, for the shapes of the
models we serve, the plan ``tune_plans.py`` found fastest on a given GPU (CUDA-graph replays of a chain of
launches over more weight bytes than the L2, 1 row); any other (GPU, shape) uses the heuristic. Plans are chosen
at build, never at capture.

Key: (``torch.cuda.get_device_name()``, kind, N, K, dtype), kind ``"qkv"`` (N = (Hq + 2 Hkv) * D, K = hidden),
``"gemm"`` or ``"gated"`` (N = output width, K = reduction). Value: (BLOCK_N, BLOCK_K, split-K, warps, stages).
``TUNED_ATTN`` holds the paged decode attention's plans (``tune_attention.py``), keyed by the step's shape.

Which GPU's entries a device reads (``plan_sources``): its own name's first, then those of every GPU in
``MEASURED_ON`` with the same compute capability and SM count, i.e. the same processor with other memory (the H100
SXM and the H200 are both sm90 with 132 SMs); a shape none of them has gets the heuristic. ``LOWLAT_MEGA_TUNED=0``
reads no table at all (the heuristics everywhere), to measure what the tables buy.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from lowlat_nvidia_mega.kernels.attention import AttnPlan, default_attn_plan, split_cap
from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan, make_plan, num_sms, plan_gemm
from lowlat_nvidia_mega.kernels.pdl import env_switch
from lowlat_nvidia_mega.kernels.qk_late import check_row1_rows
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv

# The GPUs the tables below were measured on, with their ``device_chip``: a GPU of the same chip whose own name has no
# entry for a shape reads theirs (``plan_sources``). Every device name in the tables must be here.
MEASURED_ON: dict[str, tuple[tuple[int, int], int]] = {
    "NVIDIA H200": ((9, 0), 132),
    "NVIDIA H100 80GB HBM3": ((9, 0), 132),
}

# tune_plans.py on an H200, 2026-11-30 (bench/results/2026-11-30-nvidia-mega-tuning/tune_1row.txt):
# default heuristic -> tuned, us per launch at 1 row.
TUNED: dict[tuple[str, str, int, int, str], tuple[int, int, int, int, int]] = {
    ("NVIDIA H200", "qkv", 3072, 2048, "bfloat16"): (64, 256, 4, 4, 3),     # llama-3.2-1b   13.07 -> 9.45
    # qwen3-30b-a3b: at 2-8 rows since its one-row kernel (TUNED_ROW1) serves 1 row; the 1-row winner
    # (128, 64, 8, 4, 2) -> the 8-row winner, µs at 8 rows (bench/results/2026-12-02-h200-mega-route-rows/call2).
    ("NVIDIA H200", "qkv", 5120, 2048, "bfloat16"): (128, 128, 4, 8, 3),    # qwen3-30b-a3b  22.80 -> 13.47
    ("NVIDIA H200", "gemm", 2048, 2048, "bfloat16"): (64, 64, 8, 2, 2),     # llama o_proj    6.00 -> 5.21
    ("NVIDIA H200", "gemm", 2048, 4096, "bfloat16"): (64, 128, 8, 2, 5),    # qwen3 o_proj    9.13 -> 7.15
    ("NVIDIA H200", "gated", 8192, 2048, "bfloat16"): (32, 256, 1, 4, 3),   # llama gate_up  25.57 -> 22.32
    ("NVIDIA H200", "gemm", 2048, 8192, "bfloat16"): (64, 128, 4, 2, 4),    # llama down     14.41 -> 11.97
    # 2026-12-01, qwen3-8b (bench/results/2026-12-01-h200-qwen3-speed/call6/tune_qwen3-8b.txt):
    ("NVIDIA H200", "qkv", 6144, 4096, "bfloat16"): (128, 128, 4, 8, 3),    # qwen3-8b qkv   28.86 -> 22.21
    # 2026-12-02, qwen3-8b at 8 rows (1 row runs TUNED_ROW1's one-row kernels; bench/results/
    # 2026-12-02-h200-mega-qkv-row1/call3): the 1-row winners above -> the 8-row winners, µs at 8 rows.
    ("NVIDIA H200", "gemm", 4096, 4096, "bfloat16"): (64, 64, 8, 2, 3),     # qwen3-8b o     14.85 -> 12.17
    ("NVIDIA H200", "gated", 12288, 4096, "bfloat16"): (128, 128, 1, 8, 3), # qwen3-8b gu    62.85 -> 59.15
    ("NVIDIA H200", "gemm", 4096, 12288, "bfloat16"): (64, 64, 8, 2, 3),    # qwen3-8b down  33.76 -> 29.45
}


# The one-row kernels at 1 row, as GemvPlan fields (BLOCK_N, BLOCK_K, warps, stages[, split-K[, per_sm]]); key as
# TUNED's.
# "gemm" / "gated": the GEMV (kernels/gemv.py; a default_row1 plan where absent). "qkv": qkv_rope's one-row FMA
# loop (BLOCK_N = head_dim: a head per program; BLOCK_N < head_dim: the row-pair form, models without q/k norm
# only; the tl.dot loop where absent). "qkv_late": models with q/k norm, the row-pair form with late q/k
# (kernels/qk_late.py), read before "qkv".
# tune_plans.py --row1-only on an H200, 2026-12-02 (bench/results/2026-12-02-h200-mega-gemv):
# small_gemm's tuned plan -> the GEMV, µs per launch at 1 row.
TUNED_ROW1: dict[tuple[str, str, int, int, str], tuple[int, ...]] = {
    ("NVIDIA H200", "gemm", 2048, 2048, "bfloat16"): (8, 2048, 8, 1),    # llama o_proj     5.26 -> 3.71
    ("NVIDIA H200", "gated", 8192, 2048, "bfloat16"): (2, 1024, 4, 3),   # llama gate_up   22.42 -> 19.66
    ("NVIDIA H200", "gemm", 2048, 8192, "bfloat16"): (8, 2048, 8, 1),    # llama down      12.04 -> 10.61
    ("NVIDIA H200", "gemm", 4096, 4096, "bfloat16"): (8, 1024, 8, 1),    # qwen3-8b o      11.86 -> 10.19
    ("NVIDIA H200", "gated", 12288, 4096, "bfloat16"): (4, 1024, 4, 3),  # qwen3-8b gu     59.98 -> 51.07
    ("NVIDIA H200", "gemm", 4096, 12288, "bfloat16"): (2, 1024, 4, 1),   # qwen3-8b down   29.38 -> 27.03
    # 2026-12-02 (bench/results/2026-12-02-h200-mega-qkv-row1/call1): the production tl.dot plan -> the one-row
    # kernel, µs per launch at 1 row.
    # llama qkv 9.53 -> 6.37 then; now the row-pair form below (2026-12-06)
    ("NVIDIA H200", "qkv", 6144, 4096, "bfloat16"): (128, 128, 4, 3, 8),   # qwen3-8b qkv    21.51 -> 16.16
    ("NVIDIA H200", "qkv", 5120, 2048, "bfloat16"): (128, 128, 8, 1, 8),   # qwen3-30b qkv   11.36 -> 8.66
    ("NVIDIA H200", "gemm", 2048, 4096, "bfloat16"): (8, 2048, 8, 1),      # qwen3-30b o      7.24 -> 5.97
    # 2026-12-06, the row-pair form on an H100 SXM (bench/results/2026-12-06-h100-mega-qkv-pairs): the best head per
    # program (the H200's entry above, 7.46; best 7.32) -> the best row-pair plan, µs per launch at 1 row; the
    # llama-3.2-1b DECODE b=1 step 1.0434 / 1.0448 -> 1.0351 / 1.0363 ms in A/B/A/B (plan_ab.py). On the H200
    # (bench/results/2026-12-06-h200-mega-ab/call1, the same A/B): 0.8336 / 0.8324 -> 0.8238 / 0.8240 ms.
    ("NVIDIA H100 80GB HBM3", "qkv", 3072, 2048, "bfloat16"): (8, 1024, 4, 3),  # llama qkv 7.46 -> 6.09
    ("NVIDIA H200", "qkv", 3072, 2048, "bfloat16"): (8, 1024, 4, 3),            # llama qkv, row pairs
    # 2026-12-06, late q/k on an H100 (bench/results/2026-12-06-h100-mega-moe-late): qwen3-8b DECODE b=1 in A/B/A/B,
    # ms per step with the head-per-program "qkv" entry above (read through plan_sources) -> the row-pair form with
    # late q/k: 5.5526 / 5.5558 -> 5.5379 / 5.5384. An H200 reads it too (same chip) until it has its own.
    ("NVIDIA H100 80GB HBM3", "qkv_late", 6144, 4096, "bfloat16"): (8, 1024, 4, 3),  # qwen3-8b qkv, late q/k
    # 2026-12-07, the GEMV's weight stream (per_sm, the sixth field) on an H100 SXM (bench/results/
    # 2026-12-07-h100-mega-stream): `tune_plans.py --stream` found it 1.04-1.06x the production plan at llama-3.2-1b's
    # gate_up alone; in the step (call 3, A/B/A/B, nvidia_mega alone) DECODE b=1 1.0112 / 1.0102 -> 0.9929 / 0.9903
    # ms with the entry (1, 2048, 4, 3, 1, 8), 1.0010 / 1.0004 with o_proj's stream too, 1.0237 / 1.0247 with o_proj's
    # alone. At qwen3-8b's gate_up (K 4096, two chunks) no stream paid (call 4: 5.4189 / 5.4178 against 5.4113-5.6683
    # ms).
    # 2026-12-07, session 25 (bench/results/2026-12-07-h100-session25): `tune_plans.py --stream` at 1 row found 2 rows
    # per tile, 8 warps, 4 programs per SM 1.03x that entry (1, 2048, 4, 3, 1, 8) alone (24.79 -> 23.97 µs); in the
    # step (plan_ab.py, A and B alternating, two calls) llama-3.2-1b DECODE b=1 0.9912 / 0.9916 / 0.9916 / 0.9915 ->
    # 0.9859 / 0.9864 / 0.9860 / 0.9877 / 0.9862 ms.
    ("NVIDIA H100 80GB HBM3", "gated", 8192, 2048, "bfloat16"): (2, 2048, 8, 3, 1, 4),  # llama gate_up, stream
}


# Paged decode attention. Key: (device name, "attn", batch B, rows per request R, Hq, Hkv, D, dtype). Value: AttnPlan
# fields (num_splits, block_kv, split_warps, split_stages, merge_warps), the fastest of a `tune_attention.py` run at
# its context (1024 tokens); attn_plan caps the splits at one block of max_context_len per split. Entries of
# 2026-12-02 (bench/results/2026-12-02-h200-mega-route-rows/call2): the heuristic -> the best, µs per attention call
# (split + merge; the heuristic planned for the engine's default max_context_len of 2048). Four winners of that
# sweep are left out because the whole step was slower with them (lowlat bench, call3 against call1 and the
# session before): llama-3.2-1b DECODE 1 x 1 (5.02 -> 3.60 alone; step 0.841 -> 0.851 ms) and VERIFY 1 x 6
# (6.80 -> 4.63; 1.149 -> 1.163 ms), qwen3-8b VERIFY 1 x 6 (8.44 -> 7.66; 4.830 -> 5.002 ms), qwen3-30b-a3b
# DECODE 1 x 1 (6.30 -> 3.98; 2.550 -> 2.616 ms): alone, attention follows attention; in the step it follows
# qkv_rope and precedes o_proj, which its PDL overlap shares the SMs with.
TUNED_ATTN: dict[tuple[str, str, int, int, int, int, int, str], tuple[int, int, int, int, int]] = {
    ("NVIDIA H200", "attn", 2, 1, 32, 8, 64, "bfloat16"): (16, 64, 4, 1, 1),  # llama-3.2-1b decode 5.50 -> 3.87
    ("NVIDIA H200", "attn", 4, 1, 32, 8, 64, "bfloat16"): (16, 64, 4, 1, 1),  # llama-3.2-1b decode 6.25 -> 5.74
    ("NVIDIA H200", "attn", 8, 1, 32, 8, 64, "bfloat16"): (4, 128, 4, 3, 1),  # llama-3.2-1b decode 11.33 -> 8.96
    ("NVIDIA H200", "attn", 1, 1, 32, 8, 128, "bfloat16"): (32, 32, 4, 1, 1),  # qwen3-8b decode 7.25 -> 4.37
    ("NVIDIA H200", "attn", 2, 1, 32, 8, 128, "bfloat16"): (16, 64, 8, 1, 1),  # qwen3-8b decode 10.70 -> 6.25
    ("NVIDIA H200", "attn", 4, 1, 32, 8, 128, "bfloat16"): (16, 32, 4, 2, 1),  # qwen3-8b decode 14.09 -> 8.90
    ("NVIDIA H200", "attn", 8, 1, 32, 8, 128, "bfloat16"): (8, 32, 2, 3, 1),  # qwen3-8b decode 22.88 -> 14.14
    ("NVIDIA H200", "attn", 2, 1, 32, 4, 128, "bfloat16"): (32, 32, 4, 3, 1),  # qwen3-30b-a3b decode 7.29 -> 5.03
    ("NVIDIA H200", "attn", 4, 1, 32, 4, 128, "bfloat16"): (16, 64, 8, 1, 1),  # qwen3-30b-a3b decode 11.43 -> 6.39
    ("NVIDIA H200", "attn", 8, 1, 32, 4, 128, "bfloat16"): (8, 64, 8, 1, 1),  # qwen3-30b-a3b decode 15.30 -> 9.44
    ("NVIDIA H200", "attn", 1, 6, 32, 4, 128, "bfloat16"): (16, 32, 4, 2, 2),  # qwen3-30b-a3b verify 8.57 -> 6.50
}


# Prenorm (kernels/norm_rows.py: a 2-8-row step's input norms in their own launch, the GEMMs without their norm
# prologue). Key: (device name, "dense" or "moe" (any MoE layer), hidden size, dtype). Value: the most rows per step
# it serves (2..value; more rows, and every shape without an entry, keep the fused prologues). 2026-12-02, lowlat
# bench side by side with the general path (bench/results/2026-12-02-h200-mega-prenorm-rule), llama-3.2-1b, ms
# general / fused prologues / prenorm: b=2 1.085 / 1.095 / 1.046, b=4 1.110 / 1.129 / 1.091, VERIFY 1 x 6 1.109 /
# 1.134 / 1.100, b=8 1.189 / 1.178 / 1.196 (so not at 8 rows). Left out: qwen3-30b-a3b (hidden 2048, MoE: VERIFY
# 7.324 / 7.345) and qwen3-8b (hidden 4096: 4-6% slower at 2-8 rows, bench/results/2026-12-02-h200-mega-moe/call1).
TUNED_PRENORM: dict[tuple[str, str, int, str], int] = {
    ("NVIDIA H200", "dense", 2048, "bfloat16"): 6,
}


def prenorm_rows(kind: str, hidden: int, dtype: torch.dtype, device: torch.device) -> int:
    """The most rows of a step that prenorm serves by default for this model on ``device`` (``TUNED_PRENORM``;
    ``kind`` "dense" or "moe"), else 0 (no step does). ``LOWLAT_MEGA_PRENORM`` overrides it per step."""
    return _lookup(TUNED_PRENORM, (kind, hidden, str(dtype).removeprefix("torch.")), device) or 0


def default_qkv_row1(head_dim: int, hidden: int, *, qk_norm: bool) -> GemvPlan | None:
    """qkv_rope's one-row plan for a shape without a ``TUNED_ROW1`` "qkv" entry: the row-pair form at 8 rows per
    program and K chunks of at most 1024 for a model without q/k norm (the best of 26 one-row plans at llama-3.2-1b's
    shape on an H100, 6.09 µs against 10.47 for its tl.dot loop); None (the tl.dot loop) with q/k norm, whose
    head-per-program plans were only ever measured per shape."""
    if qk_norm or head_dim <= 8:
        return None
    return GemvPlan(block_n=8, block_k=min(1024, triton.next_power_of_2(hidden)), num_warps=4, num_stages=3)


def default_row1(k: int, *, gated: bool) -> GemvPlan:
    """The one-row GEMV's plan for a shape without a ``TUNED_ROW1`` entry: within 5% of the best at each of the six
    shapes measured above (all of which it beat small_gemm at), K chunk at most 1024 (and at most K)."""
    bk = min(1024, triton.next_power_of_2(k))
    return GemvPlan(block_n=4, block_k=bk, num_warps=4, num_stages=3) if gated else \
        GemvPlan(block_n=8, block_k=bk, num_warps=8, num_stages=1)


def device_name(device: torch.device) -> str:
    """The CUDA device's name (the table's first key), or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_chip(device: torch.device) -> tuple[tuple[int, int], int] | None:
    """What a launch plan depends on besides the shape: ((major, minor) compute capability, SM count); None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


TUNED_ENV = "LOWLAT_MEGA_TUNED"


def tuned_switch() -> bool:
    """``LOWLAT_MEGA_TUNED``, read now: True (unset, empty, "default" or an on word: the measured tables), False (an
    off word: the heuristic plans for every shape). Read at build, when the plans are chosen.

    Raises:
        ValueError: any other value (a typo would measure the wrong variant).
    """
    return bool(env_switch(TUNED_ENV, True, "the measured launch plans, the default; 0: the heuristics only"))


def plan_sources(device: torch.device) -> tuple[str, ...]:
    """The GPU names whose table entries ``device`` reads, in order: its own, then every ``MEASURED_ON`` GPU of the
    same compute capability and SM count (``device_chip``); none when ``LOWLAT_MEGA_TUNED=0``.

    Raises:
        ValueError: a bad ``LOWLAT_MEGA_TUNED`` value (``tuned_switch``).
    """
    if not tuned_switch():
        return ()
    own, chip = device_name(device), device_chip(device)
    return (own, *(n for n, c in MEASURED_ON.items() if n != own and chip is not None and c == chip))


def plan_sources_line(device: torch.device) -> str:
    """One line for the tuning scripts: the tables production reads on ``device`` and its ``MEASURED_ON`` entry."""
    return (f"device {device_name(device)}: production plans read the tables of "
            f"{', '.join(plan_sources(device)) or 'no GPU (LOWLAT_MEGA_TUNED=0)'}; a new GPU's entries need its "
            f"MEASURED_ON line: {device_name(device)!r}: {device_chip(device)},")


def _lookup(table: dict, rest: tuple, device: torch.device):  # type: ignore[no-untyped-def,type-arg]
    """``table``'s entry for key ``(source, *rest)`` from the first of ``plan_sources(device)`` that has one."""
    for source in plan_sources(device):
        hit = table.get((source, *rest))
        if hit is not None:
            return hit
    return None


def _tuned(table: dict[tuple[str, str, int, int, str], tuple[int, ...]], kind: str, n: int, k: int,
           dtype: torch.dtype, device: torch.device) -> tuple[int, ...] | None:
    """``table``'s entry (``TUNED`` or ``TUNED_ROW1``) for this shape on ``device``, else None."""
    return _lookup(table, (kind, n, k, str(dtype).removeprefix("torch.")), device)


def _row1_entry(kind: str, n: int, k: int, value: tuple[int, ...]) -> GemvPlan:
    """A ``TUNED_ROW1`` value as a ``GemvPlan``.

    Raises:
        ValueError: a value that is not (BLOCK_N, BLOCK_K, warps, stages[, split-K[, per_sm]]) of valid ints, or a
            "qkv" / "qkv_late" value with a ``per_sm`` (qkv_rope's one-row loop has no weight-stream form), naming
            the entry.
    """
    head = f"TUNED_ROW1 entry ({kind!r}, {n}, {k}) = {value!r}"
    if not 4 <= len(value) <= 6:
        raise ValueError(f"{head} has {len(value)} fields; it takes 4 to 6: (BLOCK_N, BLOCK_K, warps, stages[, "
                         "split-K[, per_sm]])")
    try:
        plan = GemvPlan(*value)  # which checks every field
    except (TypeError, ValueError) as e:
        raise ValueError(f"{head} is not (BLOCK_N, BLOCK_K, warps, stages[, split-K[, per_sm]]) of valid ints: {e}") \
            from None
    if kind.startswith("qkv") and plan.per_sm:
        raise ValueError(f"{head}: qkv_rope's one-row loop has no weight-stream form, so a {kind!r} entry takes no "
                         f"per_sm (got {plan.per_sm}); per_sm is the GEMV's ('gemm' / 'gated')")
    return plan


def gemm_plan(n: int, k: int, dtype: torch.dtype, device: torch.device, *, gated: bool = False) -> GemmPlan:
    """The plan for ``[<=8, k] @ [n (2n when gated), k]^T`` on ``device``: tuned entry, else ``plan_gemm``; with
    the one-row GEMV's plan as ``row1`` (``TUNED_ROW1``, else ``default_row1``)."""
    kind = "gated" if gated else "gemm"
    hit = _tuned(TUNED, kind, n, k, dtype, device)
    if hit is None:
        plan = plan_gemm(n, k, dtype, num_sms(device), gated=gated)
    else:
        bn, bk, s, w, st = hit
        plan = make_plan(k, block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st,
                         weight_rows=(2 if gated else 1) * bn)
    row1 = _tuned(TUNED_ROW1, kind, n, k, dtype, device)
    return dataclasses.replace(plan, row1=_row1_entry(kind, n, k, row1) if row1 is not None else
                               default_row1(k, gated=gated))


def qkv_plan(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype,
             device: torch.device, *, qk_norm: bool) -> GemmPlan:
    """The fused QKV kernel's plan on ``device``: tuned entry (for this head_dim), else ``plan_qkv``; ``row1`` from a
    ``TUNED_ROW1`` "qkv" entry that this model can run, else ``default_qkv_row1``. A "qkv" entry of the row-pair
    form (``block_n`` < head_dim) serves only a model without q/k norm (``qk_norm`` False;
    ``qk_late.check_row1_rows``): the key (N, K) does not tell the two apart. A model with q/k norm reads a
    "qkv_late" entry first: the row-pair form with q/k norm and RoPE finished in the attention
    (``qk_late.late_qk``), measured as such.

    Raises:
        ValueError: a table entry this model cannot run in the form its kind names."""
    n = (num_heads + 2 * num_kv_heads) * head_dim
    hit = _tuned(TUNED, "qkv", n, hidden, dtype, device)
    if hit is None or hit[0] != head_dim:
        plan = plan_qkv(num_heads, num_kv_heads, head_dim, hidden, dtype, num_sms(device))
    else:
        _, bk, s, w, st = hit
        plan = make_plan(hidden, block_n=head_dim, block_k=bk, split_k=s, num_warps=w, num_stages=st,
                         weight_rows=head_dim)
    late = _tuned(TUNED_ROW1, "qkv_late", n, hidden, dtype, device) if qk_norm else None
    if late is not None:  # the row-pair form with late q/k, measured as such for a model with q/k norm
        r1 = _row1_entry("qkv_late", n, hidden, late)
        check_row1_rows(r1, head_dim, qk_norm, qk_late=True)
        return dataclasses.replace(plan, row1=r1)
    row1 = _tuned(TUNED_ROW1, "qkv", n, hidden, dtype, device)
    r1 = _row1_entry("qkv", n, hidden, row1) if row1 is not None else None
    if r1 is None or r1.block_n > head_dim or (r1.block_n < head_dim and qk_norm):
        r1 = default_qkv_row1(head_dim, hidden, qk_norm=qk_norm)
    if r1 is not None:
        check_row1_rows(r1, head_dim, qk_norm)
    return dataclasses.replace(plan, row1=r1)


def attn_plan(batch_size: int, rows_per_req: int, num_heads: int, num_kv_heads: int, head_dim: int,
              max_context_len: int, sms: int, dtype: torch.dtype, *, device: torch.device) -> AttnPlan:
    """The paged decode attention's plan for a step of ``batch_size`` requests x ``rows_per_req`` rows on
    ``device``: the ``TUNED_ATTN`` entry of this shape (its splits capped by ``split_cap(max_context_len,
    block_kv)``), else ``default_attn_plan`` (``sms`` and ``max_context_len`` choose its splits). Shapes only,
    never the batch's lengths, so a CUDA graph records one plan per batch size."""
    hit = _lookup(TUNED_ATTN, ("attn", batch_size, rows_per_req, num_heads, num_kv_heads, head_dim,
                               str(dtype).removeprefix("torch.")), device)
    if hit is None:
        return default_attn_plan(batch_size, rows_per_req, num_heads, num_kv_heads, head_dim, max_context_len, sms)
    splits, block_kv, split_warps, split_stages, merge_warps = hit
    return AttnPlan(num_splits=min(splits, split_cap(max_context_len, block_kv)), block_kv=block_kv,
                    split_warps=split_warps, split_stages=split_stages, merge_warps=merge_warps)
