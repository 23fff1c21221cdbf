"""The errors a fresh user meets first name the problem and the fix: a CPU torch asked for CUDA, a mistyped
model, a plugin on a CPU without the Triton interpreter, a dtype alias, the missing serve extra."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
from lowlat.cli import main
from lowlat.cli import run as run_cli
from lowlat.config import ConfigError, EngineConfig
from lowlat.loader import resolve_model
from lowlat.loader.presets import closest_preset
from lowlat.platform import Platform, no_cuda_message
from lowlat.plugin import Coverage, ForwardMode, ModelSpec, PlatformRequirement, Requirements
from lowlat.runtime.plugin_host import evaluate


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowlat")
    run_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["run", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")
def test_cuda_on_a_cpu_torch_names_the_cli_flag_python_and_the_cpu_build(capsys, monkeypatch):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    assert run_cli.run(_parse(["--device", "cuda", "--max-new-tokens", "1"])) == 2
    err = capsys.readouterr().err
    assert "--device cpu" in err and "EngineConfig(device='cpu')" in err and err.count("\n") == 1
    if torch.version.cuda is None:
        assert "is a CPU build (torch.version.cuda is None)" in err and torch.__version__ in err


def test_no_cuda_message_tells_a_cpu_build_from_a_missing_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    cpu = no_cuda_message("--device cuda", "--device cpu")
    assert "2.13.0+cpu is a CPU build" in cpu and "install a CUDA build of torch" in cpu and "--device cpu" in cpu
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    gpu = no_cuda_message("--device cuda", "--device cpu")
    assert "built for CUDA 12.8" in gpu and "CUDA_VISIBLE_DEVICES" in gpu and "CPU build" not in gpu


@pytest.mark.parametrize("typo, meant", [("llama3-tiny", "tiny-llama"), ("tiny-lama", "tiny-llama"),
                                         ("Qwen/Qwen3-8B", "qwen3-8b"), ("qwen3-moe-tiny", "tiny-qwen3-moe"),
                                         ("llama-1b", "llama-3.2-1b"), ("/missing", None), ("zzz", None)])
def test_closest_preset(typo, meant):
    assert closest_preset(typo) == meant


def test_unknown_model_suggests_a_preset_and_says_repo_ids_work(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_model("llama3-tiny")
    msg = str(e.value)
    assert "did you mean the preset 'tiny-llama'" in msg and "HF repo id (org/name)" in msg
    assert "hf download" in msg and "presets: tiny-llama" in msg
    with pytest.raises(ConfigError) as e:
        resolve_model(str(tmp_path / "missing"))
    assert "(no such path)" in str(e.value) and "did you mean" not in str(e.value)
    assert "HF repo id" in str(e.value)


def test_uncached_repo_id_suggests_a_preset(tmp_path):
    from lowlat.serve.hf_cache import resolve_model_path

    with pytest.raises(ConfigError, match=r"hf download Qwen/Qwen3-8B.*did you mean the preset 'qwen3-8b'"):
        resolve_model_path("Qwen/Qwen3-8B", cache_dir=str(tmp_path))


def _spec(*platforms: PlatformRequirement) -> ModelSpec:
    return ModelSpec(architecture="LlamaForCausalLM",
                     requirements=Requirements(platforms=platforms, dtypes=frozenset({"float32"})),
                     coverage=Coverage(modes=frozenset({ForwardMode.DECODE}), max_tokens=8), build="m:b")


def test_cpu_without_the_interpreter_says_set_it_before_python_starts():
    both = _spec(PlatformRequirement("cuda"), PlatformRequirement("cpu", triton_interpreter=True))
    reason = next(r.reason for r in evaluate("p", both, Platform("cpu", "cpu")).results if r.requirement == "platform")
    assert "set TRITON_INTERPRET=1 in the environment before Python starts" in reason
    assert "TRITON_INTERPRET=1 lowlat run" in reason
    cuda_only = _spec(PlatformRequirement("cuda"))  # no interpreter would help: no such hint
    reason = next(r.reason for r in evaluate("p", cuda_only, Platform("cpu", "cpu")).results
                  if r.requirement == "platform")
    assert "TRITON_INTERPRET" not in reason


@pytest.mark.parametrize("triton, numpy, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.1", "2.5.2", True), ("3.6.0rc1", "2.4.0", True),
    ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.2", False), ("3.6.0", "2.3.5", False), ("3.5.1", "1.26.4", False),
    (None, "2.4.6", False), ("3.6.0", None, False), ("not-a-version", "2.4.6", False)])
def test_the_interpreter_refuses_triton_36_with_numpy_24(triton, numpy, refused):
    """Triton 3.6's interpreter takes int() of a one-element NumPy array for loop bounds, which NumPy 2.4 refuses
    (every such kernel failed on the device image: triton 3.6.0, numpy 2.5.2, 2026-12-07). The guard refuses the CPU
    interpreter platform there, naming both versions and both ways out; a CUDA platform is not affected."""
    from lowlat.platform import interpreter_problem

    problem = interpreter_problem(triton, numpy)
    assert (problem is not None) is refused
    interp = _spec(PlatformRequirement("cuda"), PlatformRequirement("cpu", triton_interpreter=True))
    cpu = Platform("cpu", "cpu", triton_interpreter=True, triton_version=triton, numpy_version=numpy)
    result = next(r for r in evaluate("p", interp, cpu).results if r.requirement == "platform")
    assert (result.status == "fail") is refused, result
    if refused:
        assert problem == result.reason
        assert f"Triton {triton}" in problem and f"NumPy {numpy}" in problem
        assert "'numpy<2.4'" in problem and "'triton>=3.7'" in problem
    gpu = Platform("cuda", "NVIDIA H200", (9, 0), None, 1, True, triton, numpy)
    assert next(r for r in evaluate("p", interp, gpu).results if r.requirement == "platform").status == "pass"


@pytest.mark.parametrize("alias, name", [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"),
                                         ("half", "float16"), ("fp32", "float32"), ("float", "float32"),
                                         ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_dtype_aliases(alias, name):
    assert _parse(["--dtype", alias]).dtype == name
    assert EngineConfig(dtype=alias).dtype == name


def test_a_bad_dtype_is_refused_with_the_choices_and_aliases(capsys):
    with pytest.raises(SystemExit):
        _parse(["--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"bfloat16, float16, float32 \(or bf16, .*\), got 'int8'"):
        EngineConfig(dtype="int8")


def test_missing_serve_extra_gives_the_checkout_form(capsys, monkeypatch):
    monkeypatch.delenv("LOWLAT_DEBUG", raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    assert main(["serve", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "uvicorn is missing" in err and "pip install 'lowlat[serve]'" in err
    assert "pip install -e 'core[serve]'" in err
