"""Tests of the paged decode attention kernel: on the GPU when there is one, else under Triton's interpreter.

Triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` decorates a function, and triton.language's own jit
helpers (tl.max, tl.sum, tl.cdiv) are decorated when ``triton`` is first imported, so the variable must be set
before the first ``import triton`` in the process. conftest.py sets it (only on machines without CUDA) before
any test module is imported; if triton was imported earlier without it, the launcher raises a ValueError.
"""

from __future__ import annotations

import math

import lowlat.kernels.decode_attention as da
import pytest
import torch

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


def make_case(lens, n, hkv, group, head_dim, dtype, seed=0, max_len=None, extra_rows=2):
    """Random step inputs whose slot map is a random permutation; slots no live position uses hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    max_len = max_len or max(lens) + 5
    num_slots = batch * max_len + 1
    rows = torch.randperm(batch + extra_rows, generator=gen)[:batch]
    req_to_token = torch.zeros((batch + extra_rows, max_len), dtype=torch.int32)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1  # slot 0 stays the dummy slot
    req_to_token[rows] = perm.view(batch, max_len).to(torch.int32)
    k = torch.full((num_slots, hkv, head_dim), float("nan"), dtype=dtype)
    v = torch.full((num_slots, hkv, head_dim), float("nan"), dtype=dtype)
    for row, length in zip(rows.tolist(), lens):
        live = req_to_token[row, :length].long()
        k[live] = torch.randn((length, hkv, head_dim), generator=gen).to(dtype)
        v[live] = torch.randn((length, hkv, head_dim), generator=gen).to(dtype)
    q = torch.randn((batch * n, hkv * group, head_dim), generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k, v, req_to_token, rows.to(torch.int64), seq_lens


def run_both(case, n, num_kv_splits=None, q=None):
    q0, k, v, r2t, rows, seq_lens = (t.to(DEVICE) for t in case)
    q = q0 if q is None else q.to(DEVICE)
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)  # poisoned: every element must be written
    got = da.decode_attention(q, k, v, r2t, rows, seq_lens, n, scale, num_kv_splits, out=out)
    want = da.decode_attention_reference(q, k, v, r2t, rows, seq_lens, n, scale)
    assert got.data_ptr() == out.data_ptr()
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.isfinite(got.float()).all()
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("n", [1, 3])
def test_matches_reference(dtype, group, n):
    lens = [n, 33, 70, n + 4]  # the shortest context holds only the new tokens (length 1 for DECODE)
    case = make_case(lens, n, hkv=2, group=group, head_dim=16, dtype=dtype, seed=group * 10 + n)
    got, want = run_both(case, n)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dim_64(dtype):
    case = make_case([40, 3, 97], 3, hkv=1, group=4, head_dim=64, dtype=dtype, seed=7)
    got, want = run_both(case, 3)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_counts(splits):
    """Few splits (long loops), and more splits than KV blocks (programs that exit at once)."""
    case = make_case([70, 1, 45], 1, hkv=2, group=2, head_dim=16, dtype=torch.float32, seed=splits)
    got, want = run_both(case, 1, num_kv_splits=splits)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_several_row_blocks_and_odd_head_dim():
    """GQA group x new tokens above one 64-row tile, a head_dim that is not a power of two, strided q."""
    n, hkv, group, head_dim = 9, 1, 8, 24
    case = make_case([12, 50], n, hkv=hkv, group=group, head_dim=head_dim, dtype=torch.float32, seed=3)
    q = case[0]
    wide = torch.randn(q.shape[0], q.shape[1] * head_dim + 40)  # q as a view into a fused qkv row
    q_view = wide[:, : q.shape[1] * head_dim].view(q.shape)
    q_view.copy_(q)
    assert not q_view.is_contiguous()
    got, want = run_both(case, n, q=q_view)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_empty_context_gives_zeros():
    q, k, v, r2t, rows, _ = make_case([5, 9], 1, hkv=1, group=2, head_dim=16, dtype=torch.float32)
    seq_lens = torch.tensor([0, 9], dtype=torch.int32)
    got, want = run_both((q, k, v, r2t, rows, seq_lens), 1)
    assert (got[0] == 0).all()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_reference_equals_naive_softmax():
    n, hkv, group, head_dim = 2, 2, 2, 8
    q, k, v, r2t, rows, seq_lens = make_case([2, 7, 4], n, hkv, group, head_dim, torch.float32, seed=5)
    scale = 0.3
    got = da.decode_attention_reference(q, k, v, r2t, rows, seq_lens, n, scale)
    for t in range(q.shape[0]):
        b, j = divmod(t, n)
        visible = int(seq_lens[b]) - n + j + 1
        slots = [int(r2t[rows[b], p]) for p in range(visible)]
        for h in range(q.shape[1]):
            kv_head = h // group
            logits = [scale * float(q[t, h] @ k[s, kv_head]) for s in slots]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            expect = sum(w / total * v[s, kv_head] for w, s in zip(weights, slots))
            torch.testing.assert_close(got[t, h], expect, rtol=1e-5, atol=1e-6)


def test_default_splits_follow_shapes(monkeypatch):
    monkeypatch.setattr(da, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    one = da.default_num_kv_splits(1, 8, 4096, 1, cuda)
    many = da.default_num_kv_splits(8, 8, 4096, 1, cuda)
    assert 1 <= many < one <= 64
    assert da.default_num_kv_splits(1, 8, 100, 1, cuda) == 1  # short max_len: splits keep >= 128 tokens
    assert 1 <= da.default_num_kv_splits(1, 8, 4096, 1, torch.device("cpu")) <= 4


def _args(**over):
    q, k, v, r2t, rows, seq_lens = make_case([4, 6], 1, hkv=2, group=2, head_dim=16, dtype=torch.float32)
    args = {"q": q.to(DEVICE), "k_buffer": k.to(DEVICE), "v_buffer": v.to(DEVICE), "req_to_token": r2t.to(DEVICE),
            "req_pool_indices": rows.to(DEVICE), "seq_lens": seq_lens.to(DEVICE), "tokens_per_req": 1,
            "sm_scale": 0.25}
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"tokens_per_req": 2}, r"B \* tokens_per_req"),
        ({"q": torch.zeros(2, 3, 16, device=DEVICE)}, "multiple of KV heads"),
        ({"q": torch.zeros(2, 4, 16, dtype=torch.bfloat16, device=DEVICE)}, "share one dtype"),
        ({"q": torch.zeros(2, 4, 32, device=DEVICE)[..., ::2]}, "contiguous in its last dimension"),
        ({"q": torch.zeros(2, 4, 8, device=DEVICE)}, "head_dim differs"),
        ({"req_to_token": torch.zeros(4, 11, dtype=torch.int64, device=DEVICE)}, "req_to_token"),
        ({"seq_lens": torch.tensor([4], dtype=torch.int32, device=DEVICE)}, "seq_lens has 1 requests"),
        ({"v_buffer": torch.zeros(3, 2, 16, device=DEVICE)}, "v_buffer shape"),
        ({"num_kv_splits": 0}, "num_kv_splits"),
        ({"out": torch.zeros(2, 4, 8, device=DEVICE)}, "out must be"),
    ],
)
def test_launcher_rejects_bad_input(over, needle):
    with pytest.raises(ValueError, match=needle):
        da.decode_attention(**_args(**over))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal; CUDA machines run the compiled kernel")
def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(da, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="decode_attention_reference"):
        da.decode_attention(**_args())


def _plain_max(x):
    return x


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter behaviour; CUDA machines run the compiled kernel")
def test_interpreter_enabled_too_late_is_named(monkeypatch):
    """TRITON_INTERPRET set after ``import triton`` leaves tl.max a compiled-mode JITFunction: a ValueError says so."""
    monkeypatch.setattr(da.tl, "max", da.triton.runtime.JITFunction(_plain_max))
    with pytest.raises(ValueError, match="after triton was first imported"):
        da.decode_attention(**_args())
