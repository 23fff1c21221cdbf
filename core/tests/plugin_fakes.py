"""Sources of small plugins for runtime-integration tests (installed as real dist-info by plugin_dists).

``MIRROR`` builds a plugin that runs core's own model code on the parameters the binding hands it (so its
outputs equal the general path's); the variants break one thing each.
"""

MIRROR = """
import torch
from lowlat.plugin import Coverage, ModelSpec, PlatformRequirement, Requirements, hookimpl
from lowlat.forward_batch import ForwardMode

FAULT = %(fault)r

@hookimpl
def lowlat_model_specs():
    return [ModelSpec(
        architecture=a,
        requirements=Requirements(platforms=(PlatformRequirement("cpu"), PlatformRequirement("cuda")),
                                  dtypes=frozenset({"float32", "bfloat16"}), tp_sizes=frozenset({1, 2})),
        coverage=Coverage(modes=frozenset({ForwardMode.DECODE, ForwardMode.VERIFY}), max_tokens=8),
        build="%(module)s:build",
    ) for a in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")]


class Mirror:
    def __init__(self, binding):
        from lowlat.models import build_model
        from lowlat.distributed import TPInfo

        self.binding = binding
        self.model = build_model(binding.model_config, dtype=binding.dtype, device=binding.device,
                                 tp=TPInfo(binding.tp_rank, binding.tp_size, binding.tp_group),
                                 max_context_len=binding.engine_config.max_context_len)
        own = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(binding.params[name])
        self.calls = 0

    def supports(self, batch):
        if FAULT == "refuse_on_rank1" and self.binding.tp_rank == 1:
            return False
        return True

    def forward(self, batch):
        self.calls += 1
        if FAULT == "raises":
            raise RuntimeError("kernel exploded")
        out = self.model(batch, self.binding.kv_pool)
        if FAULT == "wrong_shape":
            return out[:, :-1]
        if FAULT == "wrong_dtype":
            return out.to(torch.bfloat16)
        if FAULT == "noisy":  # a plugin whose logits drift: greedy tokens diverge after a few steps
            return out + 3.0 * torch.randn(out.shape, generator=torch.Generator().manual_seed(self.calls))
        if FAULT == "nan" and self.calls > 1:
            return out + float("nan")
        return out


def build(binding):
    if FAULT == "build_raises":
        raise ValueError("unsupported head_dim")
    if FAULT == "build_too_big":
        binding.alloc_workspace("scratch", (1 << 50,), torch.float32)
    if FAULT == "reads_kv_early":
        binding.kv_pool
    return Mirror(binding)
"""


def mirror_source(fault: str = "") -> str:
    """A MIRROR plugin module with ``fault`` ("" for a correct one)."""
    return MIRROR.replace("%(fault)r", repr(fault))
