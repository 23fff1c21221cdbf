"""The general forward agrees with itself across PREFILL / chunked PREFILL / DECODE / VERIFY and batching."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models_util import Driver, random_model, tiny_config
from lowlat.forward_batch import ForwardMode

P, D, V = ForwardMode.PREFILL, ForwardMode.DECODE, ForwardMode.VERIFY
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module", params=("llama", "qwen3", "qwen3_moe"))
def model(request):
    return random_model(tiny_config(request.param))


def _req_kv(d: Driver, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = d.pool.slots_of(row, d.lens[row])
    return (torch.stack([k[slots] for k in d.pool.k_buffers]), torch.stack([v[slots] for v in d.pool.v_buffers]))


def test_prefill_then_decode_equals_one_prefill(model):
    one = Driver(model)
    want = one.step(P, [(one.new_req(), PROMPT)])
    two = Driver(model)
    r = two.new_req()
    two.step(P, [(r, PROMPT[:-1])])
    got = two.step(D, [(r, PROMPT[-1:])], host_lens=False)
    torch.testing.assert_close(got, want, **TOL)


def test_chunked_prefill_equals_one_prefill_and_writes_the_same_kv(model):
    one = Driver(model)
    a = one.new_req()
    want = one.step(P, [(a, PROMPT)])
    two = Driver(model)
    b = two.new_req()
    two.step(P, [(b, PROMPT[:4])])
    got = two.step(P, [(b, PROMPT[4:])], host_lens=False)  # host lengths are copied from the device if absent
    torch.testing.assert_close(got, want, **TOL)
    for x, y in zip(_req_kv(two, b), _req_kv(one, a)):
        torch.testing.assert_close(x, y, **TOL)


def test_verify_equals_single_decode_steps(model):
    draft = [7, 19, 23, 4]
    ver = Driver(model)
    a = ver.new_req()
    ver.step(P, [(a, PROMPT)])
    got = ver.step(V, [(a, draft)], host_lens=False)
    dec = Driver(model)
    b = dec.new_req()
    dec.step(P, [(b, PROMPT)])
    want = torch.cat([dec.step(D, [(b, [t])], host_lens=False) for t in draft])
    assert got.shape == (len(draft), model.config.vocab_size)
    torch.testing.assert_close(got, want, **TOL)
    for x, y in zip(_req_kv(ver, a), _req_kv(dec, b)):
        torch.testing.assert_close(x, y, **TOL)


def test_batch_of_three_equals_each_alone(model):
    prompts = [PROMPT, [8, 1], [30, 31, 32, 33, 34, 35, 36]]
    steps = [(P, prompts), (D, [[11], [12], [13]]), (V, [[1, 2, 3], [4, 5, 6], [7, 8, 9]]), (D, [[2], [3], [4]])]
    together = Driver(model)
    rows = [together.new_req() for _ in prompts]
    got = [together.step(mode, list(zip(rows, toks)), host_lens=mode is P) for mode, toks in steps]
    for i in range(3):
        alone = Driver(model)
        r = alone.new_req()
        for (mode, toks), g in zip(steps, got):
            want = alone.step(mode, [(r, toks[i])], host_lens=mode is P)
            n = want.shape[0]
            torch.testing.assert_close(g[i * n:(i + 1) * n] if mode is not P else g[i:i + 1], want, **TOL)


def test_decode_and_verify_never_read_back_to_host(model, monkeypatch):
    d = Driver(model)
    rows = [d.new_req(), d.new_req()]
    d.step(P, [(rows[0], PROMPT), (rows[1], PROMPT[:3])])
    batches = [d.batch(D, [(r, [5]) for r in rows], host_lens=False),
               d.batch(V, [(r, [1, 2, 3]) for r in rows], host_lens=False)]

    def refuse(*_a, **_k):
        raise AssertionError("host sync in a DECODE/VERIFY step")

    for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for b in batches:
        model(b, d.pool)


def test_writes_kv_only_at_out_cache_loc(model):
    d = Driver(model)
    r = d.new_req()
    d.step(P, [(r, PROMPT)])
    for buf in (*d.pool.k_buffers, *d.pool.v_buffers):
        buf[d.pool.slots_of(r, d.lens[r])[-1] + 1:] = 7.0  # sentinel in every slot after the prompt's
    before = [b.clone() for b in (*d.pool.k_buffers, *d.pool.v_buffers)]
    batch = d.batch(V, [(r, [1, 2, 3])], host_lens=False)
    model(batch, d.pool)
    written = torch.zeros(d.pool.num_slots, dtype=torch.bool)
    written[batch.out_cache_loc] = True
    for b0, b1 in zip(before, (*d.pool.k_buffers, *d.pool.v_buffers)):
        assert torch.equal(b0[~written], b1[~written])
        assert not torch.equal(b0[written], b1[written])


def test_moe_grouped_gemm_equals_expert_loop():
    model = random_model(tiny_config("qwen3_moe"))
    experts = model.model.layers[0].mlp.experts
    assert experts.use_grouped_mm, "torch._grouped_mm should run on CPU in float32 with torch >= 2.13"
    d = Driver(model)
    r = d.new_req()
    batch = d.batch(P, [(r, PROMPT)])
    want = model(batch, d.pool)
    experts.use_grouped_mm = False
    try:
        got = model(batch, d.pool)
    finally:
        experts.use_grouped_mm = True
    torch.testing.assert_close(got, want, **TOL)


def test_torch_decode_attention_matches_the_kernel_contract():
    ref = pytest.importorskip("lowlat.kernels.decode_attention").decode_attention_reference
    from lowlat.layers.attention import decode_attention_torch

    gen = torch.Generator().manual_seed(0)
    kb, vb = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    req_to_token = torch.randint(1, 64, (3, 20), generator=gen, dtype=torch.int32)
    rows = torch.tensor([2, 0, 1])
    seq_lens = torch.tensor([7, 0, 20], dtype=torch.int32)  # the middle request is a padded row
    for n in (1, 3):
        q = torch.randn(3 * n, 4, 16, generator=gen)
        got = decode_attention_torch(q, kb, vb, req_to_token, rows, seq_lens, n, 0.25)
        torch.testing.assert_close(got, ref(q, kb, vb, req_to_token, rows, seq_lens, n, 0.25), **TOL)
        assert not got[n:2 * n].any()


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.gpu)])
def test_torch_prefill_attention_with_and_without_a_cached_prefix(device, dtype):
    """Each request's new tokens see keys 0 .. their position (a cached prefix included), GQA heads shared, at a
    scale other than SDPA's default: against an explicit float32 softmax over a boolean mask (on CUDA: the flash
    backend in bf16, the efficient one in float32)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from lowlat.layers.attention import prefill_attention_torch

    tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    gen = torch.Generator().manual_seed(1)
    kb, vb = torch.randn(64, 2, 64, generator=gen), torch.randn(64, 2, 64, generator=gen)
    req_to_token = torch.randperm(64, generator=gen)[:60].reshape(3, 20).to(torch.int32)
    rows = torch.tensor([1, 2])
    seq_lens, extend_lens = [9, 14], [9, 5]  # the second request has a 9-token prefix
    q = torch.randn(sum(extend_lens), 4, 64, generator=gen)
    got = prefill_attention_torch(*(t.to(device, dtype) for t in (q, kb, vb)), req_to_token.to(device),
                                  rows.to(device), seq_lens, extend_lens, 0.2).float().cpu()
    start = 0
    for b, (seq, n) in enumerate(zip(seq_lens, extend_lens)):
        slots = req_to_token[rows[b], :seq].long()
        k, v = kb[slots].repeat_interleave(2, 1), vb[slots].repeat_interleave(2, 1)  # [seq, 4, 64]
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + n], k) * 0.2
        visible = torch.arange(seq)[None, :] <= torch.arange(seq - n, seq)[:, None]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[start:start + n], torch.einsum("hnl,lhd->nhd", p, v), **tol)
        start += n


def test_prefill_sdpa_never_runs_cudnn_and_keeps_the_users_backend_choices(monkeypatch):
    """Both prefill branches call SDPA with cuDNN disabled (a cuDNN call slows later CUDA-graph replays on the
    H200), backends the user disabled stay disabled, every flag is restored after the call, and the lower-right
    causal bias holds no storage."""
    from types import SimpleNamespace

    from lowlat.layers import attention

    seen = []

    def spy(q, k, v, **kw):
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled()))
        return F.scaled_dot_product_attention(q, k, v, **kw)

    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    kb, vb = torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    r2t = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    q = torch.randn(9, 4, 8)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    attention.prefill_attention_torch(q, kb, vb, r2t, torch.tensor([0, 1]), [6, 10], [6, 3], 0.3)
    assert len(seen) == 2 and all(not c and f for c, f, _ in seen)  # no prefix, then a 7-token prefix
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        attention.prefill_attention_torch(q[:6], kb, vb, r2t, torch.tensor([0]), [6], [6], 0.3)
        assert seen[-1] == (False, True, False)  # not turned back on for the call
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(True)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert attention.causal_lower_right(8192, 131072).numel() == 0
