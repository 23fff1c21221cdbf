"""The ModelSpecs lowlat-nvidia-mega registers: one per architecture, same requirements for all."""

from __future__ import annotations

from dataclasses import fields, replace

from lowlat.plugin import (
    PLUGIN_API_VERSION,
    Coverage,
    ForwardMode,
    ModelSpec,
    PlatformRequirement,
    Requirements,
    SamplingCoverage,
)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
HEAD_DIMS = (32, 64, 128, 256)  # powers of two the attention and QKV kernels tile
MAX_ROWS = 8  # every kernel is specialized for at most 8 rows (tokens) per step
CANDIDATES = 64  # C, the candidate list of lm_head_sample's top-k/top-p filter (kernels/sampling.py)

# --plugin auto prefers a plugin made for the machine's platform kind; cores before 0.2.1 lack the field.
_MADE_FOR = {"made_for": ("cuda",)} if "made_for" in {f.name for f in fields(Requirements)} else {}

REQUIREMENTS = Requirements(
    platforms=(
        PlatformRequirement("cuda", min_capability=(9, 0)),
        PlatformRequirement("cpu", triton_interpreter=True),
    ),
    dtypes=frozenset({"bfloat16"}),
    tp_sizes=frozenset({1}),
    libraries=(("triton", ">=3.6,<3.10"),),
    # no q/k/v/o or MLP bias in the fused kernels: refuse attention_bias=true and mlp_bias=true (the contract suite's
    # variants contract; logits were off by ~2.7 on tiny-llama with biases)
    model=(("head_dim", HEAD_DIMS), ("attention_bias", (False,)), ("mlp_bias", (False,))),
    **_MADE_FOR,
)
# Sampled ids (plugin API 3) in DECODE steps, by the fused LM head + sampling kernel. top_k <= C/2: the kernel
# keeps every token tied with the k-th logit (core's rule) as long as the tie fits in its C candidates, so a
# difference needs more than C/2 tokens tied exactly at the k-th logit. top-p only with top-k: alone, the nucleus
# may hold more than C tokens, which the kernel would truncate.
SAMPLING = SamplingCoverage(modes=frozenset({ForwardMode.DECODE}), temperature=True, max_top_k=CANDIDATES // 2,
                            top_p="with_top_k")
COVERAGE = Coverage(modes=frozenset({ForwardMode.DECODE, ForwardMode.VERIFY}), max_tokens=MAX_ROWS,
                    sampling=SAMPLING)


# The guard refuses a bad LOWLAT_MEGA_* switch before weights load (and `lowlat plugins` shows it) where core has
# ModelSpec.check_environment (plugin API 4); on older cores build refuses it.
_CHECK_ENV = ({"check_environment": "lowlat_nvidia_mega.build:check_switches"}
              if "check_environment" in {f.name for f in fields(ModelSpec)} else {})

# TP 2-8 with epilogue publishing (lowlat_nvidia_mega.tp) where core has plugin API 4 (binding.peer_buffers).
TP_SIZES = frozenset({1, 2, 4, 8}) if PLUGIN_API_VERSION >= 4 else frozenset({1})


def model_specs() -> list[ModelSpec]:
    """One spec per architecture; ``build`` is imported only when an engine builds the plugin."""
    return [
        ModelSpec(architecture=a, coverage=COVERAGE, build="lowlat_nvidia_mega.build:build",
                  requirements=replace(REQUIREMENTS, tp_sizes=TP_SIZES), **_CHECK_ENV)
        for a in ARCHITECTURES
    ]
