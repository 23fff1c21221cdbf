"""Reading an HF ``config.json`` into ModelConfig fields: every field honoured, defaulted as transformers does, or
refused by name.

``FIELDS`` is the audit (docs/checkpoint-support.md is its table): for each architecture, every field of
transformers' config class (LlamaConfig, Qwen3Config, Qwen3MoeConfig in transformers 5.24; 4.x spellings such
as top-level ``rope_theta`` / ``rope_scaling`` and Qwen3-MoE's ``num_experts`` are read too), its transformers
default, and what lowlat does with it. A field absent from config.json takes that default. Values are checked
strictly (an int field takes a JSON integer, a bool field ``true``/``false``), and every refusal is a
ConfigError naming the field, the value and what is supported. transformers is never imported here.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from lowlat.errors import ConfigError

MAX_LAYERS = 10_000  # a cheap bound checked before anything is sized by the layer count
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ROPE = SUPPORTED_ROPE_TYPES

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
SUPPORTED_ACTS = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")

# transformers' defaults (the config classes' field defaults, after their __post_init__ rules).
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "pad_token_id": None, "rope_theta": 10000.0,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "mlp_bias": False,
              "head_dim": None, "pretraining_tp": 1},
    "qwen3": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None, "bos_token_id": None, "eos_token_id": None},
    "qwen3_moe": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
                  "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                  "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001, "bos_token_id": None,
                  "eos_token_id": None},
}

# What lowlat does with each field. "math": implemented and compared with transformers (tests named in
# docs/checkpoint-support.md); "refused ...": a ConfigError unless the value is the supported one;
# "ignored: ..." does not change inference output in transformers either.
_ATTN = {
    "vocab_size": "math: embedding/lm_head rows; must exceed every special id",
    "hidden_size": "math", "intermediate_size": "math", "num_hidden_layers": f"math (1..{MAX_LAYERS})",
    "num_attention_heads": "math", "num_key_value_heads": "math: MHA/GQA/MQA; must divide num_attention_heads",
    "head_dim": "math: even; may differ from hidden_size / num_attention_heads",
    "hidden_act": "refused unless silu (or swish)", "max_position_embeddings": "math: RoPE table bound; "
    "llama3 original length default; max_context_len above it warns", "rms_norm_eps": "math (> 0)",
    "tie_word_embeddings": "math", "rope_parameters": f"math for rope_type {', '.join(SUPPORTED_ROPE)}; "
    "other types and partial_rotary_factor != 1 refused", "attention_bias": "math (q/k/v/o biases)",
    "attention_dropout": "ignored: training only (0 <= p <= 1 checked)",
    "initializer_range": "ignored: training only", "use_cache": "ignored: lowlat always caches",
    "pad_token_id": "ignored: no effect on logits (checked < vocab_size)",
    "bos_token_id": "tokenizer/prompt only (checked < vocab_size)",
    "eos_token_id": "stopping: int or list, all ids stop (checked < vocab_size)",
    "dtype": "GPU compute dtype when dtype=auto; refused outside bfloat16/float16/float32",
    "transformers_version": "ignored", "architectures": "exactly one supported name",
    "output_hidden_states": "ignored: output format", "return_dict": "ignored: output format",
    "chunk_size_feed_forward": "ignored: not read by these models", "is_encoder_decoder": "refused if true",
    "id2label": "ignored: classification heads", "label2id": "ignored: classification heads",
    "problem_type": "ignored: classification heads",
}
FIELDS: dict[str, dict[str, str]] = {
    "llama": {**_ATTN, "mlp_bias": "math (gate/up/down biases)",
              "pretraining_tp": "ignored: not read by transformers 5 (4.x: same math, sliced matmuls)"},
    "qwen3": {**_ATTN, "use_sliding_window": "refused if it makes any layer sliding",
              "sliding_window": "refused if any layer is sliding", "max_window_layers": "refused if it makes "
              "any layer sliding", "layer_types": "refused unless every entry is full_attention"},
    "qwen3_moe": {**_ATTN, "use_sliding_window": "refused if true with a sliding_window",
                  "sliding_window": "refused if use_sliding_window", "decoder_sparse_step": "math (>= 1)",
                  "moe_intermediate_size": "math", "num_experts_per_tok": "math (1..num_experts)",
                  "num_experts": "math (>= 1; also read as num_local_experts)", "norm_topk_prob": "math",
                  "output_router_logits": "ignored: training output", "router_aux_loss_coef":
                  "ignored: training only", "mlp_only_layers": "math (dense layers)"},
}
# Keys transformers accepts beside the fields (aliases, legacy spellings, bookkeeping); not warned about.
ALIASES = {"rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype", "num_local_experts", "_name_or_path",
           "model_type", "output_attentions", "head_dim", "max_window_layers", "tokenizer_class",
           "_attn_implementation_autoset", "bad_words_ids", "quantization_config", "auto_map"}
REFUSED_KEYS = {"quantization_config": "quantized checkpoints are not supported yet; use an unquantized "
                                       "(bfloat16/float16/float32) checkpoint",
                "compression_config": "compressed checkpoints are not supported yet; use an unquantized one"}


def _fail(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"config.json field {key}={value!r} is not supported: {want}; fix config.json or use "
                       "another checkpoint")


def _get(d: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    return d[key] if key in d else defaults.get(key)


def read_int(key: str, v: Any, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``v`` as an int field of config.json. Raises ConfigError naming ``key`` for a non-integer or out-of-range."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config.json field {key}={v!r} must be an integer (a JSON number such as 32), "
                          f"not {type(v).__name__}; fix config.json")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"config.json field {key}={v} must be {bound}; fix config.json")
    return v


def read_float(key: str, v: Any, *, positive: bool = True) -> float:
    """``v`` as a finite float field (ints accepted). Raises ConfigError naming ``key``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"config.json field {key}={v!r} must be a finite number; fix config.json")
    if positive and v <= 0:
        raise ConfigError(f"config.json field {key}={v} must be > 0; fix config.json")
    return float(v)


def read_bool(key: str, v: Any) -> bool:
    """``v`` as a JSON boolean. Raises ConfigError naming ``key`` for anything else (e.g. the string "false")."""
    if not isinstance(v, bool):
        raise ConfigError(f"config.json field {key}={v!r} must be true or false; fix config.json")
    return v


def _token_ids(key: str, v: Any, vocab: int, *, many: bool) -> int | tuple[int, ...] | None:
    if v is None:
        return None
    if many and isinstance(v, list):
        ids = tuple(read_int(key, i, minimum=0, maximum=vocab - 1) for i in v)
        return ids if ids else None
    return read_int(key, v, minimum=0, maximum=vocab - 1)


def _rope(d: dict[str, Any], mt: str, max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None for default), with transformers 5's precedence: rope_scaling over
    rope_parameters; a theta in the dict over a top-level rope_theta over the default."""
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rs, dict):
        raise ConfigError(f"config.json field rope_parameters={rs!r} must be an object; fix config.json")
    if isinstance(rs.get("full_attention"), dict):  # nested by layer type (all layers are full attention)
        rs = rs["full_attention"]
    rs = dict(rs)
    theta = rs.get("rope_theta", d.get("rope_theta", DEFAULTS[mt]["rope_theta"]))
    theta = read_float("rope_theta", theta)
    prf = rs.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise _fail("partial_rotary_factor", prf, "lowlat rotates the whole head (1.0)")
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in SUPPORTED_ROPE:
        raise _fail("rope_parameters.rope_type", kind, f"supported rope types are {', '.join(SUPPORTED_ROPE)}")
    if kind == "default":
        return theta, None
    out: dict[str, Any] = {"rope_type": kind, "factor": read_float("rope_parameters.factor", rs.get("factor"))}
    if kind == "llama3":
        low = read_float("rope_parameters.low_freq_factor", rs.get("low_freq_factor"))
        high = read_float("rope_parameters.high_freq_factor", rs.get("high_freq_factor"))
        if low == high:
            raise _fail("rope_parameters.high_freq_factor", high, "it must differ from low_freq_factor")
        # transformers 5.24 ignores a top-level original_max_position_embeddings for these models (warned as unknown)
        old = read_int("rope_parameters.original_max_position_embeddings",
                       rs.get("original_max_position_embeddings", max_pos))
        out.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=old)
    return theta, out


def _sliding(d: dict[str, Any], mt: str, layers: int) -> None:
    dflt = DEFAULTS[mt]
    use = read_bool("use_sliding_window", _get(d, "use_sliding_window", dflt))
    window = _get(d, "sliding_window", dflt) if use else None
    if mt == "qwen3_moe":
        if window is not None:
            raise _fail("use_sliding_window", True, "sliding-window attention is not implemented (false)")
        return
    types = d.get("layer_types")
    if types is None:
        start = read_int("max_window_layers", _get(d, "max_window_layers", dflt), minimum=0)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or any(t != "full_attention" for t in types):
        raise _fail("layer_types" if "layer_types" in d else "use_sliding_window",
                    types if "layer_types" in d else use,
                    "sliding-window attention is not implemented (every layer full_attention)")


def hf_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a parsed config.json ``d``.

    Raises:
        ConfigError: naming the field, its value and what is supported, for an unsupported architecture or
            model_type, a refused feature (quantization, sliding windows, other activations or rope types), or an
            invalid value (wrong JSON type, non-positive size, out-of-vocabulary special id, ...).
    Warns:
        UserWarning: listing config.json keys that are neither fields of the architecture nor known aliases
            (transformers ignores them too, but they may mean a checkpoint of another model).
    """
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise ConfigError(f"config.json field architectures={archs!r} must name exactly one architecture")
    arch = archs[0]
    if arch not in MODEL_TYPES:
        raise _fail("architectures", archs, f"lowlat runs {', '.join(MODEL_TYPES)}")
    mt = MODEL_TYPES[arch]
    if d.get("model_type", mt) != mt:
        raise _fail("model_type", d["model_type"], f"{arch} checkpoints have model_type {mt!r}")
    for key, why in REFUSED_KEYS.items():
        if d.get(key):
            method = d[key].get("quant_method") if isinstance(d[key], dict) else None
            raise ConfigError(f"config.json has {key} (quant_method={method!r}): {why}")
    if d.get("is_encoder_decoder"):
        raise _fail("is_encoder_decoder", True, "decoder-only models (false)")
    dflt = DEFAULTS[mt]
    known = set(FIELDS[mt]) | ALIASES | set(dflt)
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        warnings.warn(f"config.json keys not read by lowlat (nor by transformers' {mt} model): {', '.join(unknown)}; "
                      "a checkpoint that needs them (custom code) would run without them", stacklevel=3)
    if d.get("auto_map"):
        warnings.warn("config.json has auto_map (custom modeling code); lowlat runs its own "
                      f"{arch} forward, not that code", stacklevel=3)

    def integer(key: str, **kw: Any) -> int:
        v = _get(d, key, dflt)
        if v is None:
            raise ConfigError(f"config.json field {key} is null and transformers' {mt} config has no default for it")
        return read_int(key, v, **kw)

    act = _get(d, "hidden_act", dflt)
    if act not in SUPPORTED_ACTS:
        raise _fail("hidden_act", act, "lowlat's MLPs use silu")
    layers = integer("num_hidden_layers", maximum=MAX_LAYERS)
    heads = integer("num_attention_heads")
    hidden = integer("hidden_size")
    kv = _get(d, "num_key_value_heads", dflt)
    kv = heads if kv is None else read_int("num_key_value_heads", kv)
    hd = d.get("head_dim", dflt["head_dim"])
    if hd is None:
        if hidden % heads:
            raise _fail("hidden_size", hidden, f"a multiple of num_attention_heads={heads} when head_dim is absent")
        hd = hidden // heads
    hd = read_int("head_dim", hd)
    vocab = integer("vocab_size")
    max_pos = integer("max_position_embeddings")
    theta, scaling = _rope(d, mt, max_pos)
    if mt != "llama":
        _sliding(d, mt, layers)
    dropout = read_float("attention_dropout", _get(d, "attention_dropout", dflt), positive=False)
    if not 0.0 <= dropout <= 1.0:
        raise _fail("attention_dropout", dropout, "a probability in [0, 1]")
    if mt == "llama" and _get(d, "pretraining_tp", dflt) is not None:
        integer("pretraining_tp")
    pad = _get(d, "pad_token_id", dflt)
    if pad is not None:
        read_int("pad_token_id", pad, minimum=-vocab, maximum=vocab - 1)
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    if dtype not in WEIGHT_DTYPES:
        raise _fail("dtype", dtype, f"unquantized weights in {', '.join(WEIGHT_DTYPES)}")
    out: dict[str, Any] = dict(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=integer("intermediate_size"),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        rms_norm_eps=read_float("rms_norm_eps", _get(d, "rms_norm_eps", dflt)), rope_theta=theta,
        max_position_embeddings=max_pos, rope_scaling=scaling,
        tie_word_embeddings=read_bool("tie_word_embeddings", _get(d, "tie_word_embeddings", dflt)),
        attention_bias=read_bool("attention_bias", _get(d, "attention_bias", dflt)),
        mlp_bias=read_bool("mlp_bias", _get(d, "mlp_bias", dflt)) if mt == "llama" else False,
        torch_dtype=dtype,
        bos_token_id=_token_ids("bos_token_id", _get(d, "bos_token_id", dflt), vocab, many=False),
        eos_token_id=_token_ids("eos_token_id", _get(d, "eos_token_id", dflt), vocab, many=True),
    )
    if mt == "qwen3_moe":
        experts = d.get("num_experts", d.get("num_local_experts", dflt["num_experts"]))
        experts = read_int("num_experts", experts)
        only = _get(d, "mlp_only_layers", dflt) or []
        if not isinstance(only, list):
            raise _fail("mlp_only_layers", only, "a list of layer indices")
        read_float("router_aux_loss_coef", _get(d, "router_aux_loss_coef", dflt), positive=False)
        out.update(num_experts=experts,
                   num_experts_per_tok=read_int("num_experts_per_tok", _get(d, "num_experts_per_tok", dflt),
                                                maximum=experts),
                   moe_intermediate_size=integer("moe_intermediate_size"),
                   norm_topk_prob=read_bool("norm_topk_prob", _get(d, "norm_topk_prob", dflt)),
                   decoder_sparse_step=integer("decoder_sparse_step"),
                   mlp_only_layers=tuple(read_int("mlp_only_layers[]", i, minimum=0) for i in only))
    return out
