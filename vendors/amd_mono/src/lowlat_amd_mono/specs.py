"""The ModelSpecs lowlat-amd-mono registers: one per architecture, each at tp_size 1, 2, 4, 8 (plugin API 4)."""

from __future__ import annotations

from dataclasses import fields

from lowlat.plugin import PLUGIN_API_VERSION, Coverage, ForwardMode, ModelSpec, PlatformRequirement, Requirements

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
HEAD_DIMS = (32, 64, 128, 256)  # powers of two the attention and QKV kernels tile
MAX_ROWS = 8  # tokens per step the persistent kernels are built for

# --plugin auto prefers a plugin made for the machine's platform kind; cores before 0.2.1 lack the field.
_MADE_FOR = {"made_for": ("rocm",)} if "made_for" in {f.name for f in fields(Requirements)} else {}

REQUIREMENTS = Requirements(
    platforms=(
        PlatformRequirement("rocm", archs=("gfx942", "gfx950")),
        PlatformRequirement("cuda", min_capability=(9, 0)),  # development and measurement on Hopper
        PlatformRequirement("cpu", triton_interpreter=True),  # stage-per-launch mode for CPU tests
    ),
    dtypes=frozenset({"bfloat16"}),
    # Every architecture at TP 2-8 (o_proj, down and the MoE's expert down publish across ranks,
    # ``lowlat_amd_mono.tp``) where core has plugin API 4 (binding.peer_buffers); else tp_size 1 only.
    tp_sizes=frozenset({1, 2, 4, 8}) if PLUGIN_API_VERSION >= 4 else frozenset({1}),
    libraries=(("triton", ">=3.6,<3.10"),),
    # no q/k/v/o or MLP bias in the fused kernels: refuse attention_bias=true and mlp_bias=true (the contract suite's
    # variants contract; logits were off by ~2.7 on tiny-llama with biases)
    model=(("head_dim", HEAD_DIMS), ("attention_bias", (False,)), ("mlp_bias", (False,))),
    **_MADE_FOR,
)
COVERAGE = Coverage(modes=frozenset({ForwardMode.DECODE, ForwardMode.VERIFY}), max_tokens=MAX_ROWS)


def model_specs() -> list[ModelSpec]:
    """One spec per architecture; ``build`` is imported only when an engine builds the plugin."""
    return [
        ModelSpec(architecture=a, coverage=COVERAGE, build="lowlat_amd_mono.build:build", requirements=REQUIREMENTS)
        for a in ARCHITECTURES
    ]
