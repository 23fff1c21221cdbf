"""A whole MegaForward step against a hand-written torch reference of a tiny model.

The model is built through the real ``PluginBinding`` and ``KVPool``; the reference recomputes the step with
plain torch (core's rms_norm / RoPE / decode attention helpers) on a copy of the pool. Checks: logits, K/V at
exactly ``out_cache_loc`` in every layer, every other slot unchanged (sentinel values), coverage refusals and
build errors. CPU under ``TRITON_INTERPRET=1``, or a CUDA GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from lowlat.config import EngineConfig, ModelConfig
from lowlat.errors import PluginBuildError
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.layers.attention import decode_attention_torch
from lowlat.layers.norm import rms_norm
from lowlat.layers.rotary import RotaryEmbedding, apply_rotary
from lowlat.plugin.binding import PluginBinding
from lowlat_nvidia_mega import build as build_mod
from lowlat_nvidia_mega import forward as forward_mod
from lowlat_nvidia_mega.build import build
from lowlat_nvidia_mega.kernels import pdl, tuned_plans
from lowlat_nvidia_mega.kernels.attention import AttnPlan, partial_numel
from lowlat_nvidia_mega.kernels.gemm_plans import GemvPlan

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
MAX_CTX, PAGE, SENTINEL = 64, 4, 5.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _config(arch: str) -> ModelConfig:
    moe = arch == "Qwen3MoeForCausalLM"
    return ModelConfig(
        architecture=arch, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=MAX_CTX, tie_word_embeddings=arch == "Qwen3ForCausalLM",
        rope_scaling=LLAMA3 if arch == "LlamaForCausalLM" else None,
        num_experts=8 if moe else 0, num_experts_per_tok=2 if moe else 0, moe_intermediate_size=32 if moe else 0,
        mlp_only_layers=(1,) if moe else (),
    )


def _params(mc: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, hq, hkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads

    def w(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEV)

    def norm(n: int) -> torch.Tensor:
        return (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=DEV)

    p = {"model.embed_tokens.weight": w(mc.vocab_size, h, scale=1.0), "model.norm.weight": norm(h)}
    p["lm_head.weight"] = p["model.embed_tokens.weight"] if mc.tie_word_embeddings else w(mc.vocab_size, h)
    for i in range(mc.num_hidden_layers):
        pre = f"model.layers.{i}."
        p[pre + "input_layernorm.weight"] = norm(h)
        p[pre + "post_attention_layernorm.weight"] = norm(h)
        p[pre + "self_attn.qkv_proj.weight"] = w((hq + 2 * hkv) * d, h)
        p[pre + "self_attn.o_proj.weight"] = w(h, hq * d)
        if mc.has_qk_norm:
            p[pre + "self_attn.q_norm.weight"] = norm(d)
            p[pre + "self_attn.k_norm.weight"] = norm(d)
        if mc.is_moe_layer(i):
            e, inter = mc.num_experts, mc.moe_intermediate_size
            p[pre + "mlp.gate.weight"] = w(e, h, scale=0.5)
            p[pre + "mlp.experts.w13_weight"] = w(e, 2 * inter, h)
            p[pre + "mlp.experts.w2_weight"] = w(e, h, inter)
        else:
            p[pre + "mlp.gate_up_proj.weight"] = w(2 * mc.intermediate_size, h)
            p[pre + "mlp.down_proj.weight"] = w(h, mc.intermediate_size)
    return p


def _binding(mc: ModelConfig, dtype: torch.dtype, params: dict[str, torch.Tensor], tp_size: int = 1
             ) -> PluginBinding:
    ec = EngineConfig(device=DEV.type, max_context_len=MAX_CTX, page_size=PAGE, plugin="nvidia_mega")
    return PluginBinding(plugin="nvidia_mega", model_config=mc, engine_config=ec, device=DEV, dtype=dtype,
                         params=params, tp_size=tp_size)


def _pool_and_batch(mc: ModelConfig, dtype: torch.dtype, mode: ForwardMode, prefix_lens: list[int], rows: int
                    ) -> tuple[KVPool, ForwardBatch]:
    """A KV pool whose prefix slots hold random K/V and every other slot the sentinel, and the step's batch."""
    g = torch.Generator().manual_seed(7)
    pool = KVPool(num_layers=mc.num_hidden_layers, num_pages=48, page_size=PAGE, num_kv_heads=mc.num_key_value_heads,
                  head_dim=mc.head_dim, dtype=dtype, device=DEV, max_reqs=8, max_context_len=MAX_CTX)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.fill_(SENTINEL)
    reqs, locs = [], []
    for plen in prefix_lens:
        row = pool.alloc_req()
        pool.alloc_req()  # leave a gap so request rows are not 0, 1, 2, ...
        prefix_slots = pool.alloc_slots(row, plen)
        for buf in pool.k_buffers + pool.v_buffers:
            buf[prefix_slots] = torch.randn(plen, mc.num_key_value_heads, mc.head_dim, generator=g).to(buf)
        locs.append(pool.alloc_slots(row, plen + rows))
        reqs.append(row)
    ids = torch.randint(0, mc.vocab_size, (len(reqs) * rows,), generator=g).tolist()
    batch = ForwardBatch.build(mode, ids, prefix_lens, [rows] * len(reqs), reqs, torch.cat(locs), DEV)
    return pool, batch


def _reference(mc: ModelConfig, p: dict[str, torch.Tensor], kb: list[torch.Tensor], vb: list[torch.Tensor],
               rtt: torch.Tensor, batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
    """The step in plain torch (HF Llama / Qwen3 / Qwen3-MoE math); writes K/V into ``kb`` / ``vb``."""
    t, d, eps = batch.num_tokens, mc.head_dim, mc.rms_norm_eps
    hq, hkv = mc.num_attention_heads, mc.num_key_value_heads
    x = p["model.embed_tokens.weight"][batch.input_ids]
    cos, sin = RotaryEmbedding(d, mc.rope_theta, mc.rope_scaling, MAX_CTX, device=DEV)(batch.positions, dtype)
    for i in range(mc.num_hidden_layers):
        pre = f"model.layers.{i}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q, k, v = F.linear(h, p[pre + "self_attn.qkv_proj.weight"]).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if mc.has_qk_norm:
            q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kb[i][batch.out_cache_loc] = k
        vb[i][batch.out_cache_loc] = v
        o = decode_attention_torch(q, kb[i], vb[i], rtt, batch.req_pool_indices, batch.seq_lens,
                                   batch.tokens_per_req, d ** -0.5)
        x = x + F.linear(o.reshape(t, -1), p[pre + "self_attn.o_proj.weight"])
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        if mc.is_moe_layer(i):
            probs = torch.softmax(F.linear(h, p[pre + "mlp.gate.weight"]).float(), dim=-1)
            wts, ids = torch.topk(probs, mc.num_experts_per_tok, dim=-1)
            wts = (wts / wts.sum(-1, keepdim=True)).to(dtype)
            moe = torch.zeros_like(x, dtype=torch.float32)
            for r in range(t):
                for j in range(mc.num_experts_per_tok):
                    e = int(ids[r, j])
                    gate, up = F.linear(h[r], p[pre + "mlp.experts.w13_weight"][e]).chunk(2)
                    y = F.linear(F.silu(gate) * up, p[pre + "mlp.experts.w2_weight"][e])
                    moe[r] += wts[r, j].float() * y.float()
            x = (x.float() + moe).to(dtype)
        else:
            gate, up = F.linear(h, p[pre + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])
    h = rms_norm(x, p["model.norm.weight"], eps)
    return F.linear(h, p["lm_head.weight"]).float()


STEPS = [  # (architecture, dtype, mode, prefix lengths, rows per request)
    ("LlamaForCausalLM", torch.float32, ForwardMode.DECODE, [5, 17, 0], 1),
    ("Qwen3ForCausalLM", torch.bfloat16, ForwardMode.VERIFY, [9, 30], 4),
    ("Qwen3MoeForCausalLM", torch.float32, ForwardMode.DECODE, [3, 12], 1),
]


@pytest.mark.parametrize("arch,dtype,mode,prefix_lens,rows", STEPS, ids=["llama-decode", "qwen3-verify", "moe"])
def test_step_matches_reference_and_writes_only_out_cache_loc(arch: str, dtype: torch.dtype, mode: ForwardMode,
                                                              prefix_lens: list[int], rows: int) -> None:
    _check_step(arch, dtype, mode, prefix_lens, rows)


@pytest.mark.parametrize("arch,dtype,pairs", [("LlamaForCausalLM", torch.float32, False),
                                              ("LlamaForCausalLM", torch.bfloat16, True),
                                              ("Qwen3ForCausalLM", torch.bfloat16, False),
                                              ("Qwen3ForCausalLM", torch.bfloat16, True),
                                              ("Qwen3MoeForCausalLM", torch.float32, True)])
def test_one_row_step_matches_reference(arch: str, dtype: torch.dtype, pairs: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 DECODE step: the projections through the one-row GEMV (every plan has ``row1`` by default) and,
    here also qkv_rope through its one-row loop (a head per program split over K in 2, or ``pairs``: the row-pair
    form, 4 rows per program, which for Qwen3 leaves q/k raw for the attention to finish: ``qk_late``), against the
    reference forward; the build tells ``qkv_plan`` the model's q/k norm."""
    real = build_mod.qkv_plan
    seen = []

    def with_row1(hq, hkv, d, hid, dt, dev, *, qk_norm):  # type: ignore[no-untyped-def]
        seen.append(qk_norm)
        r1 = GemvPlan(block_n=4, block_k=32, num_warps=4, num_stages=1) if pairs else \
            GemvPlan(block_n=d, block_k=16, num_warps=4, num_stages=1, split_k=2)
        return dataclasses.replace(real(hq, hkv, d, hid, dt, dev, qk_norm=qk_norm), row1=r1)
    monkeypatch.setattr(build_mod, "qkv_plan", with_row1)
    _check_step(arch, dtype, ForwardMode.DECODE, [11], 1)
    assert seen == [arch != "LlamaForCausalLM"], "the build must take qkv_rope's plan from qkv_plan, with q/k norm"


@pytest.mark.parametrize("arch,dtype,mode,prefix_lens,rows", STEPS[:2], ids=["llama-decode", "qwen3-verify"])
def test_step_with_a_tuned_attention_plan(arch: str, dtype: torch.dtype, mode: ForwardMode, prefix_lens: list[int],
                                          rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``TUNED_ATTN`` entry with more splits and smaller KV blocks than the heuristic (1 split of 64 here): the
    build takes it for that (batch, rows) only, capped at one block of MAX_CTX per split, sizes the attention
    workspaces for it, and the step still matches the reference."""
    b = len(prefix_lens)
    dt = str(dtype).removeprefix("torch.")
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "Test GPU")
    monkeypatch.setitem(tuned_plans.TUNED_ATTN, ("Test GPU", "attn", b, rows, 4, 2, 32, dt), (64, 16, 2, 1, 1))
    _check_step(arch, dtype, mode, prefix_lens, rows)
    fwd = build(_binding(_config(arch), dtype, _params(_config(arch), dtype)))
    plan = AttnPlan(MAX_CTX // 16, 16, 2, 1, 1)
    assert fwd.attn_plans[(b, rows)] == plan
    assert fwd.attn_plans[(1, 1)].num_splits == 1 and fwd.attn_plans[(1, 1)].block_kv == 64
    n_o, n_l = partial_numel(b, 4, 2, 32, rows, plan)
    assert fwd.ws.o_partial.numel() >= n_o and fwd.ws.lse_partial.numel() >= n_l


def test_lm_head_config_from_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOWLAT_MEGA_LM_HEAD_CONFIG`` (read once at build) reaches the step's LM head launch, and a one-row step
    matches the reference with its rows padded to 8 (``min_rows``, the default) and unpadded (``min_rows=1``, set
    by the variable: a value other than the default, so a config that never reaches the launch is caught)."""
    seen = []
    real = forward_mod.lm_head_logits

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["config"])
        return real(*args, **kwargs)
    monkeypatch.setattr(forward_mod, "lm_head_logits", spy)
    for value, want in (("", 8), ("min_rows=1", 1)):
        seen.clear()
        monkeypatch.setenv("LOWLAT_MEGA_LM_HEAD_CONFIG", value)
        _check_step("LlamaForCausalLM", torch.float32, ForwardMode.DECODE, [11], 1)
        assert seen and all(c.min_rows == want for c in seen)


def _count_norm_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each ``norm_rows`` launch MegaForward makes from now on (the launch itself still runs)."""
    launches: list[int] = []
    real = forward_mod.norm_rows

    def spy(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(x.shape[0])
        return real(x, *args, **kwargs)
    monkeypatch.setattr(forward_mod, "norm_rows", spy)
    return launches


@pytest.mark.parametrize("arch,dtype,mode,prefix_lens,rows", STEPS, ids=["llama-decode", "qwen3-verify", "moe"])
def test_prenorm_step_matches_reference(arch: str, dtype: torch.dtype, mode: ForwardMode, prefix_lens: list[int],
                                        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOWLAT_MEGA_PRENORM=1``: every 2-8-row step normalizes qkv_rope's and gate_up's inputs with ``norm_rows``
    (one launch per norm: 2 per dense layer, 1 per MoE layer, whose norm stays in moe_forward) and still matches the
    reference; a one-row step launches none."""
    launches = _count_norm_rows(monkeypatch)
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "1")
    _check_step(arch, dtype, mode, prefix_lens, rows)
    mc = _config(arch)
    dense = sum(not mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    t = len(prefix_lens) * rows
    assert launches == [t] * (mc.num_hidden_layers + dense)
    launches.clear()
    _check_step(arch, dtype, ForwardMode.DECODE, [7], 1)
    assert launches == [], "a one-row step keeps the fused prologues"
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "maybe")  # refused at build, before any step
    with pytest.raises(PluginBuildError, match="LOWLAT_MEGA_PRENORM"):
        _check_step(arch, dtype, mode, prefix_lens, rows)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_prenorm_rule_from_the_table(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``LOWLAT_MEGA_PRENORM`` unset, a step is a prenorm step exactly when it has 2 to
    ``tuned_plans.TUNED_PRENORM``'s rows for the model's (GPU, dense/moe, hidden, dtype); 1 forces every 2-8-row
    step and 0 none. Each step still matches the reference."""
    launches = _count_norm_rows(monkeypatch)
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "Test GPU")
    monkeypatch.setitem(tuned_plans.TUNED_PRENORM, ("Test GPU", "dense", 64, "float32"), 3)
    moe = arch == "Qwen3MoeForCausalLM"
    fwd = build(_binding(_config(arch), torch.float32, _params(_config(arch), torch.float32)))
    assert fwd.prenorm_max_rows == (0 if moe else 3)
    for env, rows, want in ((None, 3, not moe), (None, 4, False), (None, 1, False), ("1", 4, True), ("0", 2, False),
                            ("1", 1, False)):
        if env is None:
            monkeypatch.delenv("LOWLAT_MEGA_PRENORM", raising=False)
        else:
            monkeypatch.setenv("LOWLAT_MEGA_PRENORM", env)
        launches.clear()
        _check_step(arch, torch.float32, ForwardMode.VERIFY if rows > 1 else ForwardMode.DECODE, [6], rows)
        assert bool(launches) is want, (env, rows, launches)


@pytest.mark.skipif(not pdl.interpreting(), reason="bit identity holds for the interpreter's reductions")
@pytest.mark.parametrize("arch,dtype,mode,prefix_lens,rows", STEPS, ids=["llama-decode", "qwen3-verify", "moe"])
def test_prenorm_step_is_bit_identical_to_fused(arch: str, dtype: torch.dtype, mode: ForwardMode,
                                                prefix_lens: list[int], rows: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_rows computes what the fused prologues compute (same ``row_rstd`` / ``load_rows``), so a prenorm step
    gives the fused step's logits and K/V bit for bit; the reference tolerances (2e-2 in bf16) would not see a
    changed rounding order."""
    mc = _config(arch)
    params = _params(mc, dtype)
    binding = _binding(mc, dtype, params)
    fwd = build(binding)
    pool, batch = _pool_and_batch(mc, dtype, mode, prefix_lens, rows)
    binding.attach_kv_pool(pool)
    got = []
    for v in ("0", "1"):
        monkeypatch.setenv("LOWLAT_MEGA_PRENORM", v)
        logits = fwd.forward(batch)
        loc = batch.out_cache_loc
        got.append((logits, *(b[loc].clone() for b in pool.k_buffers), *(b[loc].clone() for b in pool.v_buffers)))
    for fused, pre in zip(*got, strict=True):
        assert torch.equal(pre, fused)


def _check_step(arch: str, dtype: torch.dtype, mode: ForwardMode, prefix_lens: list[int], rows: int) -> None:
    mc = _config(arch)
    params = _params(mc, dtype)
    binding = _binding(mc, dtype, params)
    fwd = build(binding)
    pool, batch = _pool_and_batch(mc, dtype, mode, prefix_lens, rows)
    assert not fwd.supports(batch), "a step before the KV pool exists must be refused"
    binding.attach_kv_pool(pool)
    assert fwd.supports(batch)
    kb = [b.clone() for b in pool.k_buffers]
    vb = [b.clone() for b in pool.v_buffers]
    ref = _reference(mc, params, kb, vb, pool.req_to_token, batch, dtype)

    logits = fwd.forward(batch)
    assert logits.dtype == torch.float32 and logits.shape == (batch.num_tokens, mc.vocab_size)
    _assert_close(logits, ref, dtype)
    if dtype == torch.float32:  # bf16 roundings may legitimately flip near-ties
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    loc = batch.out_cache_loc
    others = torch.ones(pool.num_slots, dtype=torch.bool, device=DEV)
    others[loc] = False
    for i in range(mc.num_hidden_layers):
        for got, want in ((pool.k_buffers[i], kb[i]), (pool.v_buffers[i], vb[i])):
            _assert_close(got[loc].float(), want[loc].float(), dtype)
            assert torch.equal(got[others], want[others]), f"layer {i}: a slot outside out_cache_loc changed"


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: elementwise. bf16: both sides carry ~1% of rounding noise after a layer (the bf16 reference is as
    far from an fp32 run as the plugin is), so compare the relative L2 error and the worst element to the scale."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        return
    rel = ((got - want).norm() / want.norm()).item()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 2e-2 and worst < 2e-2, f"relative L2 error {rel:.4f}, worst element {worst:.4f} of the max"


def test_supports_refuses_steps_outside_coverage() -> None:
    mc = _config("LlamaForCausalLM")
    binding = _binding(mc, torch.float32, _params(mc, torch.float32))
    fwd = build(binding)
    pool, decode = _pool_and_batch(mc, torch.float32, ForwardMode.DECODE, [3, 4], 1)
    binding.attach_kv_pool(pool)
    assert fwd.supports(decode)
    prefill = ForwardBatch.build(ForwardMode.PREFILL, [1, 2, 3], [0], [3], [0],
                                 torch.tensor([4, 5, 6]), DEV)
    assert not fwd.supports(prefill)
    big = ForwardBatch.build(ForwardMode.VERIFY, list(range(9)), [0], [9], [0], torch.arange(4, 13), DEV)
    assert not fwd.supports(big)
    with pytest.raises(ValueError, match="general path"):
        fwd.forward(prefill)


def test_build_names_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    mc = _config("Qwen3ForCausalLM")
    params = _params(mc, torch.float32)
    for var in ("LOWLAT_MEGA_PRENORM", "LOWLAT_MEGA_PREFETCH_ACT", "LOWLAT_MEGA_TUNED"):  # a typo fails at start-up
        monkeypatch.setenv(var, "maybe")
        with pytest.raises(PluginBuildError, match=f"{var}='maybe'"):
            build(_binding(mc, torch.float32, params))
        monkeypatch.delenv(var)
    monkeypatch.setenv("LOWLAT_MEGA_MOE_CONFIG", "row_1=1")  # the MoE config too, at build
    with pytest.raises(PluginBuildError, match="LOWLAT_MEGA_MOE_CONFIG: 'row_1=1' must be FIELD=INT"):
        build(_binding(mc, torch.float32, params))
    monkeypatch.setenv("LOWLAT_MEGA_MOE_CONFIG", "down_warps=4")  # a known switch with a good value builds
    build(_binding(mc, torch.float32, params))
    monkeypatch.delenv("LOWLAT_MEGA_MOE_CONFIG")
    monkeypatch.setenv("LOWLAT_MEGA_LM_HEAD_CONFIG", "min_rows=3")  # and the LM head's
    with pytest.raises(PluginBuildError, match="LOWLAT_MEGA_LM_HEAD_CONFIG='min_rows=3'"):
        build(_binding(mc, torch.float32, params))
    monkeypatch.setenv("LOWLAT_MEGA_LM_HEAD_CONFIG", "block_v=32")  # below the sampler's candidates per tile
    with pytest.raises(PluginBuildError, match="block_v=32 is below the sampler's 64 candidates"):
        build(_binding(mc, torch.float32, params))
    monkeypatch.setenv("LOWLAT_MEGA_LM_HEAD_CONFIG", "min_rows=2,block_v=256")
    built = build(_binding(mc, torch.float32, params))
    assert built.head_config.min_rows == 2 and built.ws.head.block_v == 256  # the sampler's tiles follow it
    monkeypatch.delenv("LOWLAT_MEGA_LM_HEAD_CONFIG")
    monkeypatch.setenv("LOWLAT_MEGA_PRENROM", "1")  # a misspelled switch is refused, with the right name
    with pytest.raises(PluginBuildError, match="LOWLAT_MEGA_PRENROM: did you mean LOWLAT_MEGA_PRENORM"):
        build(_binding(mc, torch.float32, params))
    monkeypatch.delenv("LOWLAT_MEGA_PRENROM")
    monkeypatch.setenv("LOWLAT_MEGA_COMPILE_CHECK", "1")  # the test suite's own switch is not refused
    monkeypatch.setenv("LOWLAT_MEGA_PDL", "0")
    build(_binding(mc, torch.float32, params))
    # At TP the parameters must be this rank's shards (the general model's), named with the shape expected
    with pytest.raises(PluginBuildError, match=r"self_attn.qkv_proj.weight' is \(256, 64\), nvidia_mega expects "
                                               r"\(128, 64\)"):
        build(_binding(mc, torch.float32, params, tp_size=2))
    moe = _config("Qwen3MoeForCausalLM")
    with pytest.raises(PluginBuildError, match="self_attn.qkv_proj.weight' is"):  # the MoE model too (shards)
        build(_binding(moe, torch.float32, _params(moe, torch.float32), tp_size=2))
    with pytest.raises(PluginBuildError, match="tp_size=3 does not divide num_attention_heads=4"):
        build(_binding(mc, torch.float32, params, tp_size=3))
    del params["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(PluginBuildError, match="model.layers.1.self_attn.k_norm.weight"):
        build(_binding(mc, torch.float32, params))


def test_build_accounts_workspaces() -> None:
    mc = _config("LlamaForCausalLM")
    binding = _binding(mc, torch.float32, _params(mc, torch.float32))
    build(binding)
    assert binding.workspace_bytes >= 4 * (8 * mc.hidden_size + MAX_CTX * mc.head_dim)
