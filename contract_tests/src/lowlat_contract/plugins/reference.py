"""The reference plugin: Llama / Qwen3 / Qwen3-MoE decode in plain torch, written apart from ``lowlat.models``.

It is ``lowlat.plugin.ReferenceStep`` with no stage overridden, registered for the three architectures: it
shows what a plugin does with the interface and passes every contract. The step builds its own weight layout
from ``binding.params`` at build time (transposed views, ``x @ W_t`` instead of ``F.linear``, with its own
q/k/v, gate/up and expert offsets; views, so the weights are not held twice), reads the KV
pool through ``binding.on_kv_pool_ready``, and runs its own paged attention (one SDPA call over each
request's gathered ``req_to_token`` row, masked by *position*), RoPE with core's tables from
``binding.rope_cos_sin()`` (so positions rotate bit for bit as on the general path), q/k RMSNorm and a
dense-over-experts MoE (every expert computed, combined with zero weight for the unselected ones: simple and
capturable). Math: docs/decoder-math.md (HF ``modeling_llama`` / ``modeling_qwen3`` / ``modeling_qwen3_moe``).

Tensor parallelism (sizes 1 and 2): the parameters are already this rank's shards; attention and MLP outputs
are summed with ``all_reduce`` and the vocab-parallel logits concatenated with ``all_gather`` over
``binding.tp_group``. Nothing reads host-side values, so DECODE and VERIFY steps are CUDA-graph capturable.
The names the broken variants and the suite use (``rms``, ``neox_rotate``, ``LayerWeights``,
``ReferenceForward`` and its ``_store_kv`` / ``_visible`` / ``_gather_logits`` ... seams, ``last_routing``)
are ReferenceStep's, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowlat.forward_batch import ForwardMode
from lowlat.plugin import (
    Coverage,
    ModelSpec,
    PlatformRequirement,
    ReferenceStep,
    Requirements,
    SamplingCoverage,
    hookimpl,
)
from lowlat.plugin.reference_step import LayerWeights, neox_rotate, rms

__all__ = ["ARCHITECTURES", "BUILD", "HOOKS", "MAX_TOKENS", "LayerWeights", "ReferenceForward", "SpecHooks", "build",
           "neox_rotate", "reference_specs", "rms"]

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MAX_TOKENS = 16
BUILD = "lowlat_contract.plugins.reference:build"


def reference_specs(build: str = BUILD) -> list[ModelSpec]:
    """One spec per architecture: CPU or CUDA, float32 or bfloat16, TP 1 or 2, DECODE+VERIFY up to 16 tokens;
    sampled ids (plugin API 3) for every sampling setting (``ReferenceStep.sample``: ``lowlat.plugin.sample_ids``)."""
    req = Requirements(platforms=(PlatformRequirement("cpu"), PlatformRequirement("cuda")),
                       dtypes=frozenset({"float32", "bfloat16"}), tp_sizes=frozenset({1, 2}))
    modes = frozenset({ForwardMode.DECODE, ForwardMode.VERIFY})
    cov = Coverage(modes=modes, max_tokens=MAX_TOKENS,
                   sampling=SamplingCoverage(modes=modes, max_top_k=1 << 30, top_p="any"))
    return [ModelSpec(architecture=a, requirements=req, coverage=cov, build=build) for a in ARCHITECTURES]


class SpecHooks:
    """A pluggy plugin object whose ``lowlat_model_specs`` hook returns ``specs()``.

    An object (not a module) so that several fixture plugins can share one module: each entry point names its
    own instance (``lowlat_contract.plugins.reference:HOOKS``), and pluggy registers each once.
    """

    def __init__(self, specs: Callable[[], list[ModelSpec]]) -> None:
        self._specs = specs

    @hookimpl
    def lowlat_model_specs(self) -> list[ModelSpec]:
        return self._specs()


HOOKS = SpecHooks(reference_specs)


class ReferenceForward(ReferenceStep):
    """The PluginForward of the reference plugin: ``lowlat.plugin.ReferenceStep`` with no stage overridden.

    Raises (at build):
        PluginBuildError: a parameter the architecture needs is missing or misshapen.
        ValueError: an unsupported rope type, or shapes that do not fit the model config.
    """


def build(binding: Any) -> ReferenceForward:
    """The spec's ``build``: a ReferenceForward over this rank's parameters."""
    return ReferenceForward(binding)
