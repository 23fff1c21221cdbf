"""The config.json audit: every transformers field is in the table, absent fields take transformers' defaults,
unsupported values are refused by name, and every invalid value is a ConfigError naming the field."""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path

import pytest
from lowlat.config import ConfigError, EngineConfig, ModelConfig
from lowlat.hf_config import ALIASES, DEFAULTS, FIELDS, MODEL_TYPES
from lowlat.loader import get_preset
from lowlat.models.variants import UNSUPPORTED, Unsupported

tf = pytest.importorskip("transformers")

CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}
ARCH_OF = {mt: arch for arch, mt in MODEL_TYPES.items()}
DOC = Path(__file__).parents[2] / "docs" / "checkpoint-support.md"


def _hf_fields(mt: str) -> set[str]:
    cls = getattr(tf, CONFIG_CLASSES[mt])
    if dataclasses.is_dataclass(cls):  # transformers >= 5
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}  # transformers 4.x


@pytest.mark.parametrize("mt", list(CONFIG_CLASSES))
def test_every_transformers_field_is_audited(mt: str) -> None:
    fields = _hf_fields(mt)
    assert fields - set(FIELDS[mt]) - ALIASES == set(), "a transformers config field lowlat has not audited"
    if tf.__version__.startswith("5."):
        read_anyway = {"head_dim"} if mt == "qwen3_moe" else set()  # not a field, but modeling reads it if given
        assert set(FIELDS[mt]) - fields - read_anyway == set(), "the audit lists a field transformers does not have"


@pytest.mark.parametrize("mt", list(CONFIG_CLASSES))
def test_every_audited_field_is_in_the_docs_table(mt: str) -> None:
    text = DOC.read_text()
    section = text.split(f"### {ARCH_OF[mt]}")[1].split("###")[0]
    rows = {line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")}
    assert rows == set(FIELDS[mt])


@pytest.mark.parametrize("mt", list(CONFIG_CLASSES))
def test_absent_fields_take_transformers_defaults(mt: str) -> None:
    hf = getattr(tf, CONFIG_CLASSES[mt])()
    ours = ModelConfig.from_hf_dict({"architectures": [ARCH_OF[mt]], "model_type": mt})
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta, "rope_type": "default"}
    want = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
                num_key_value_heads=hf.num_key_value_heads, head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
                rope_theta=rope["rope_theta"], rope_scaling=None, max_position_embeddings=hf.max_position_embeddings,
                tie_word_embeddings=hf.tie_word_embeddings, attention_bias=hf.attention_bias,
                mlp_bias=getattr(hf, "mlp_bias", False), bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id)
    assert rope["rope_type"] == "default"
    if mt == "qwen3_moe":
        want.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                    decoder_sparse_step=hf.decoder_sparse_step, mlp_only_layers=tuple(hf.mlp_only_layers))
    if mt == "qwen3":
        assert set(hf.layer_types) == {"full_attention"}
    assert {k: getattr(ours, k) for k in want} == want


def test_defaults_that_were_guessed_before() -> None:
    """The absent-field defaults lowlat used to guess differently from transformers (each changed the math)."""
    moe = ModelConfig.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"]})
    assert (moe.norm_topk_prob, moe.num_key_value_heads, moe.num_experts) == (False, 4, 128)
    qwen3 = ModelConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64})
    assert qwen3.head_dim == 128 and qwen3.num_key_value_heads == 32
    llama = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"]})
    assert (llama.max_position_embeddings, llama.bos_token_id, llama.eos_token_id) == (2048, 1, 2)
    rope = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "rope_theta": 5.0,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert rope.rope_theta == 7.0  # transformers 5: the rope dict's theta wins over a top-level one
    llama3 = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
                                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0}})
    assert llama3.rope_scaling["original_max_position_embeddings"] == 512
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "original_max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}
    for rope_orig in (128, None):  # in the rope dict it counts; top level only, transformers ignores it
        if rope_orig is None:
            del d["rope_parameters"]["original_max_position_embeddings"]
        hf = tf.LlamaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        want = hf.rope_parameters["original_max_position_embeddings"]
        with pytest.warns(UserWarning, match="original_max_position_embeddings"):
            assert ModelConfig.from_hf_dict(d).rope_scaling["original_max_position_embeddings"] == want
        assert want == (rope_orig or 2048)


@pytest.mark.parametrize("u", UNSUPPORTED, ids=lambda u: u.name)
def test_unsupported_is_refused_by_name(u: Unsupported) -> None:
    d = u.hf_dict()
    if u.field != "model_type":  # transformers itself accepts the value: a real checkpoint configuration
        kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures")}
        getattr(tf, CONFIG_CLASSES[MODEL_TYPES[d["architectures"][0]]])(**kw)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict(d)
    msg = str(e.value)
    assert u.field in msg and ("supported" in msg or "not implemented" in msg), msg
    if isinstance(u.value, str):
        assert repr(u.value) in msg


def test_swish_is_silu_and_supported_sliding_settings_load() -> None:
    base = get_preset("tiny-qwen3").to_hf_dict()
    assert ModelConfig.from_hf_dict({**base, "hidden_act": "swish"}) == get_preset("tiny-qwen3")
    # use_sliding_window with max_window_layers >= layers leaves every layer full attention (transformers' rule)
    ok = {**base, "use_sliding_window": True, "max_window_layers": 2, "sliding_window": 8}
    assert ModelConfig.from_hf_dict(ok) == get_preset("tiny-qwen3")
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        ModelConfig.from_hf_dict({**ok, "max_window_layers": 1})


def _llama(**kw: object) -> dict:
    return {**get_preset("tiny-llama").to_hf_dict(), **kw}


def _moe(**kw: object) -> dict:
    return {**get_preset("tiny-qwen3-moe").to_hf_dict(), **kw}


BROKEN = [
    (_llama(rms_norm_eps=-1e-6), r"rms_norm_eps=-1e-06 must be > 0"),
    (_llama(rms_norm_eps="tiny"), r"rms_norm_eps='tiny' must be a finite number"),
    (_llama(num_hidden_layers=0), r"num_hidden_layers=0 must be in \[1, 10000\]"),
    (_llama(num_hidden_layers=-3), r"num_hidden_layers=-3 must be"),
    (_llama(num_hidden_layers="abc"), r"num_hidden_layers='abc' must be an integer .* not str"),
    (_llama(num_hidden_layers=2.5), r"num_hidden_layers=2.5 must be an integer"),
    (_llama(num_hidden_layers=True), r"num_hidden_layers=True must be an integer"),
    (_llama(num_hidden_layers=10**12), r"num_hidden_layers=1000000000000 must be in \[1, 10000\]"),
    (_llama(num_hidden_layers=None), r"num_hidden_layers is null"),
    (_llama(num_attention_heads=0), r"num_attention_heads=0 must be >= 1"),
    (_llama(hidden_size=0), r"hidden_size=0 must be >= 1"),
    (_llama(hidden_size="64"), r"hidden_size='64' must be an integer"),
    (_llama(intermediate_size=-5), r"intermediate_size=-5 must be >= 1"),
    (_llama(vocab_size=0), r"vocab_size=0 must be >= 1"),
    (_llama(vocab_size=100), r"bos_token_id=256 must be in \[0, 99\]"),
    (_llama(vocab_size=257), r"eos_token_id=257 must be in \[0, 256\]"),
    (_llama(eos_token_id=[257, -1]), r"eos_token_id=-1 must be in"),
    (_llama(pad_token_id=10**6), r"pad_token_id=1000000 must be in"),
    (_llama(head_dim=33), r"head_dim=33 must be even"),
    (_llama(head_dim=0), r"head_dim=0 must be >= 1"),
    (_llama(head_dim=None, hidden_size=66), r"hidden_size=66 is not supported: a multiple of num_attention_heads"),
    (_llama(num_key_value_heads=3), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (_llama(num_key_value_heads=0), r"num_key_value_heads=0 must be >= 1"),
    (_llama(max_position_embeddings=0), r"max_position_embeddings=0 must be >= 1"),
    (_llama(rope_theta=0, rope_scaling=None), r"rope_theta=0 must be > 0"),
    (_llama(rope_theta="abc", rope_scaling=None), r"rope_theta='abc' must be a finite number"),
    (_llama(rope_scaling={"rope_type": "linear", "factor": -2.0}), r"factor=-2.0 must be > 0"),
    (_llama(rope_scaling={"rope_type": "linear"}), r"factor=None must be a finite number"),
    (_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}),
     r"high_freq_factor=2.0 is not supported: it must differ from low_freq_factor"),
    (_llama(rope_scaling=[1, 2]), r"rope_parameters=\[1, 2\] must be an object"),
    (_llama(tie_word_embeddings="false"), r"tie_word_embeddings='false' must be true or false"),
    (_llama(attention_bias=1), r"attention_bias=1 must be true or false"),
    (_llama(mlp_bias="yes"), r"mlp_bias='yes' must be true or false"),
    (_llama(attention_dropout=2.0), r"attention_dropout=2.0 is not supported: a probability"),
    (_llama(pretraining_tp=0), r"pretraining_tp=0 must be >= 1"),
    (_llama(torch_dtype="float8_e4m3fn"), r"dtype='float8_e4m3fn' is not supported: unquantized weights"),
    (_llama(architectures=["LlamaForCausalLM", "Qwen3ForCausalLM"]), r"must name exactly one architecture"),
    (_llama(architectures=["MistralForCausalLM"]), r"architectures=\['MistralForCausalLM'\] is not supported"),
    (_llama(is_encoder_decoder=True), r"is_encoder_decoder=True is not supported"),
    (_moe(num_experts=0), r"num_experts=0 must be >= 1"),
    (_moe(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, 8\]"),
    (_moe(num_experts_per_tok=0), r"num_experts_per_tok=0 must be in"),
    (_moe(moe_intermediate_size=0), r"moe_intermediate_size=0 must be >= 1"),
    (_moe(decoder_sparse_step=0), r"decoder_sparse_step=0 must be >= 1"),
    (_moe(mlp_only_layers="0"), r"mlp_only_layers='0' is not supported: a list of layer indices"),
    (_moe(mlp_only_layers=[-1]), r"mlp_only_layers\[\]=-1 must be >= 0"),
    (_moe(norm_topk_prob="true"), r"norm_topk_prob='true' must be true or false"),
    (_moe(router_aux_loss_coef="x"), r"router_aux_loss_coef='x' must be a finite number"),
]


@pytest.mark.parametrize("d,match", BROKEN, ids=[m for _, m in BROKEN])
def test_invalid_value_names_the_field(d: dict, match: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(d)
    assert time.perf_counter() - t0 < 0.5  # cheap: nothing is sized by a bad value first


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("num_hidden_layers", 20_000), ("head_dim", 31),
                                         ("rms_norm_eps", -1.0), ("rope_theta", float("nan")), ("vocab_size", 10),
                                         ("num_key_value_heads", 3)])
def test_modelconfig_validates_direct_construction(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(get_preset("tiny-llama"), **{field: value})


def test_modelconfig_refuses_mlp_bias_outside_llama_and_unknown_rope() -> None:
    with pytest.raises(ConfigError, match="mlp_bias=True is a LlamaForCausalLM field"):
        dataclasses.replace(get_preset("tiny-qwen3"), mlp_bias=True)
    with pytest.raises(ConfigError, match="rope_type='yarn' is not supported"):
        dataclasses.replace(get_preset("tiny-llama"), rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_mlp_bias_in_a_qwen3_config_is_ignored_as_transformers_does() -> None:
    with pytest.warns(UserWarning, match="keys not read by lowlat .*: mlp_bias"):
        cfg = ModelConfig.from_hf_dict({**get_preset("tiny-qwen3").to_hf_dict(), "mlp_bias": True})
    assert cfg.mlp_bias is False


def test_unknown_keys_warn_once_and_auto_map_warns() -> None:
    with pytest.warns(UserWarning, match="keys not read by lowlat .*: attn_logit_softcapping, sliding_window"):
        ModelConfig.from_hf_dict(_llama(sliding_window=4096, attn_logit_softcapping=50.0))
    with pytest.warns(UserWarning, match="auto_map"):
        ModelConfig.from_hf_dict(_llama(auto_map={"AutoModelForCausalLM": "x.Y"}))


def test_zero_layers_in_a_checkpoint_dir_is_a_config_error(tmp_path) -> None:
    from lowlat.loader import resolve_model

    (tmp_path / "config.json").write_text(json.dumps(_llama(num_hidden_layers=0)))
    with pytest.raises(ConfigError, match="num_hidden_layers=0"):
        resolve_model(str(tmp_path))


def test_max_context_len_above_max_position_warns_or_refuses() -> None:
    model = dataclasses.replace(get_preset("tiny-llama"), max_position_embeddings=1024)
    EngineConfig(max_context_len=1024).check_model(model)
    with pytest.warns(UserWarning, match="max_context_len=2048 exceeds the model's max_position_embeddings=1024"):
        EngineConfig(max_context_len=2048).check_model(model)
    with pytest.raises(ConfigError, match="max_context_len=2048 exceeds .*pass max_context_len <= 1024"):
        EngineConfig(max_context_len=2048, strict_max_position=True).check_model(model)


def test_defaults_table_covers_every_audited_field_with_a_default() -> None:
    for mt, fields in FIELDS.items():
        missing = {f for f in fields if f not in DEFAULTS[mt]} - {
            "architectures", "transformers_version", "dtype", "output_hidden_states", "return_dict",
            "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
            "initializer_range", "use_cache", "rope_parameters"}
        assert not missing, (mt, missing)


IGNORED_VALUES = {"initializer_range": 0.5, "use_cache": False, "output_router_logits": True,
                  "router_aux_loss_coef": 0.5, "attention_dropout": 0.3, "transformers_version": "4.0.0",
                  "output_hidden_states": True, "return_dict": False, "chunk_size_feed_forward": 4,
                  "id2label": {"0": "a"}, "label2id": {"a": 0}, "problem_type": "regression", "pad_token_id": 0,
                  "pretraining_tp": 4, "is_encoder_decoder": False}


@pytest.mark.parametrize("mt", list(CONFIG_CLASSES))
def test_ignored_fields_do_not_change_the_config(mt: str) -> None:
    """Fields the audit marks "ignored" take any valid value without changing what lowlat computes."""
    preset = {"llama": "tiny-llama", "qwen3": "tiny-qwen3", "qwen3_moe": "tiny-qwen3-moe"}[mt]
    base = get_preset(preset).to_hf_dict()
    ignored = [f for f, how in FIELDS[mt].items() if how.startswith("ignored") or f == "pad_token_id"]
    assert ignored
    for f in ignored:
        assert ModelConfig.from_hf_dict({**base, f: IGNORED_VALUES[f]}) == get_preset(preset), f


# config.json of meta-llama/Llama-3.2-1B, Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B as published (transcribed; 4.x spellings)
PUBLISHED = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_configs_load_silently_as_the_presets(preset: str) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = ModelConfig.from_hf_dict(PUBLISHED[preset])
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    assert dataclasses.replace(get_preset(preset), **ids) == cfg
