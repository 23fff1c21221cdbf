"""Compile the fused LM head + sampling kernel for sm90 at the launches the tests and benchmarks make, without a GPU
(LOWLAT_MEGA_COMPILE_CHECK=1, which the gpu-tests job and ``nox -s tests -- <this file>`` set, like
``test_compile_sm90.py``).

The launch is captured from ``lm_head_sample`` / ``lm_head_logits`` themselves (meta tensors, nothing allocated),
and the signature is specialized as Triton's runtime does it (``native_specialize_impl``: an int equal to 1 becomes
a constant, a multiple of 16 gets a divisibility hint, unless the kernel says ``do_not_specialize``), so the
compile sees what a GPU launch would. The chi-square test's launch (vocab 64 = one tile of 64, hidden 16, 8 rows,
8 candidates, fan-in 2, fp32) used to fail in ``ConvertTritonGPUToLLVM`` with Triton 3.6: ``n_tiles == 1`` was
specialized to a constant, SCCP proved the merge-tree loop dead, and lowering its unreachable loads read empty
AxisInfo. Run without ``TRITON_INTERPRET``:

    LOWLAT_MEGA_COMPILE_CHECK=1 PYTHONPATH=core/src:vendors/nvidia_mega/src \\
        python -m pytest vendors/nvidia_mega/tests/test_compile_sm90_lm_head.py -q
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lowlat_nvidia_mega.kernels import pdl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if pdl.interpreting() or os.environ.get("LOWLAT_MEGA_COMPILE_CHECK") != "1":
    pytest.skip("sm90 compile check: set LOWLAT_MEGA_COMPILE_CHECK=1, unset TRITON_INTERPRET",
                allow_module_level=True)

from lowlat_nvidia_mega.kernels import lm_head  # noqa: E402
from lowlat_nvidia_mega.kernels.sampling import LMHeadWorkspace  # noqa: E402
from sm90_launch import capture, compile_ptx  # noqa: E402

META = torch.device("meta")
KERNEL = lm_head._lm_head_kernel  # before any test replaces it with a recorder


def _capture(monkeypatch: pytest.MonkeyPatch, launch) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[no-untyped-def]
    return capture(monkeypatch, lm_head, "_lm_head_kernel", launch, pdl_modules=(lm_head,))


def _compile(bound: dict[str, Any], options: dict[str, Any]) -> str:
    return compile_ptx(KERNEL, bound, options)


def _sample_launch(vocab: int, hidden: int, rows: int, dtype: torch.dtype, ws_kw: dict[str, int], filtering: bool,
                   logits: bool, use_pdl: bool, cfg: lm_head.LMHeadConfig | None = None):  # type: ignore[no-untyped-def]
    def launch() -> None:
        x = torch.empty(rows, hidden, dtype=dtype, device=META)
        norm_w = torch.empty(hidden, dtype=dtype, device=META)
        w = torch.empty(vocab, hidden, dtype=dtype, device=META)
        ws = LMHeadWorkspace.allocate(8, vocab, META, **ws_kw)
        temp = torch.empty(rows, device=META)
        top_k = torch.empty(rows, dtype=torch.int32, device=META) if filtering else None
        top_p = torch.empty(rows, device=META) if filtering else None
        seeds = torch.empty(rows, dtype=torch.int64, device=META)
        tokens = torch.empty(rows, dtype=torch.int64, device=META)
        out = torch.empty(rows, vocab, device=META) if logits else None
        lm_head.lm_head_sample(x, norm_w, w, 1e-6, temp, top_k, top_p, seeds, seeds, tokens, ws, pdl=use_pdl,
                               out_logits=out, config=cfg)
    return launch


# name: (vocab, hidden, rows, dtype, workspace, filtering, out_logits, pdl, config)
SAMPLE_LAUNCHES = {
    # test_kernels_lm_head.py::test_sampled_distribution_chi_square: one tile, so n_tiles == 1
    "chi-square": (64, 16, 8, torch.float32, dict(block_v=64, candidates=8, fan_in=2), True, True, False,
                   lm_head.LMHeadConfig(block_v=64, block_k=64)),
    # test_sampling_matches_reference_with_same_noise's one-row case: n_rows == 1 specialized too
    "one-row-5-tiles": (320, 64, 1, torch.float32, dict(block_v=64, candidates=8, fan_in=4), True, True, False,
                        lm_head.LMHeadConfig(block_v=64, block_k=64)),
    # bench_moe_head.py: qwen3-30b-a3b head, top-k 20 / top-p 0.95, default workspace and config, PDL
    "qwen3-30b-a3b-t1": (151936, 2048, 1, torch.bfloat16, {}, True, False, True, None),
    "qwen3-30b-a3b-t8": (151936, 2048, 8, torch.bfloat16, {}, True, False, True, None),
}


@pytest.mark.parametrize("name", list(SAMPLE_LAUNCHES))
def test_lm_head_sample_compiles_for_sm90(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, hidden, rows, dtype, ws_kw, filtering, logits, use_pdl, cfg = SAMPLE_LAUNCHES[name]
    bound, options = _capture(monkeypatch, _sample_launch(vocab, hidden, rows, dtype, ws_kw, filtering, logits,
                                                          use_pdl, cfg))
    assert bound["SAMPLE"] == 2 and bound["FILTER"] == filtering
    ptx = _compile(bound, options)
    assert "atom.global" in ptx, "n_tiles must stay a runtime value: a constant 1 lets SCCP drop the merge tree"
    if use_pdl:
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_lm_head_logits_compiles_for_sm90(prefetch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain logits launch of ``MegaForward`` (llama-3.2-1b's vocabulary, 8 rows, PDL), with and without the
    activation prefetch."""
    def launch() -> None:
        x = torch.empty(8, 2048, dtype=torch.bfloat16, device=META)
        out = torch.empty(8, 128256, device=META)
        lm_head.lm_head_logits(x, torch.empty(2048, dtype=torch.bfloat16, device=META),
                               torch.empty(128256, 2048, dtype=torch.bfloat16, device=META), 1e-5, out, pdl=True,
                               prefetch_act=prefetch)
    bound, options = _capture(monkeypatch, launch)
    assert bound["PREFETCH_ACT"] is prefetch
    ptx = _compile(bound, options)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert any("cp.async.cg.shared.global" in ln and "0x10" in ln for ln in ptx.splitlines()), \
        "weight tiles must stream as 16-byte asynchronous copies"


@pytest.mark.parametrize("min_rows", [1, 8])
def test_one_row_logits_take_wgmma_when_padded(min_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LMHeadConfig.min_rows=8`` at one row: the tile's dot has N = 8 and compiles to sm90's warpgroup MMA
    (``wgmma ... m64n8k16``, the weight tile read from shared memory); at N = 1 Triton pads to ``mma.sync
    m16n8k16`` (the tile through registers). qwen3-30b-a3b's vocabulary, PDL, the default tiles."""
    def launch() -> None:
        x = torch.empty(1, 2048, dtype=torch.bfloat16, device=META)
        out = torch.empty(1, 151936, device=META)
        lm_head.lm_head_logits(x, torch.empty(2048, dtype=torch.bfloat16, device=META),
                               torch.empty(151936, 2048, dtype=torch.bfloat16, device=META), 1e-6, out, pdl=True,
                               config=lm_head.LMHeadConfig(min_rows=min_rows))
    bound, options = _capture(monkeypatch, launch)
    assert bound["ROWS_C"] == min_rows
    ptx = _compile(bound, options)
    assert ("wgmma.mma_async" in ptx) == (min_rows == 8), "only the padded dot takes the warpgroup MMA"
    assert ("mma.sync.aligned.m16n8k16" in ptx) == (min_rows == 1)
