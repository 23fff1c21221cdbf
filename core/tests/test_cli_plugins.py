"""``lowlat plugins`` as a user runs it: a subprocess over real installed distributions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from plugin_dists import GOOD_SPEC, make_plugin_dist


def lowlat(site, *args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "lowlat.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_plugins_json_lists_good_broken_and_guard(tmp_path):
    site = tmp_path / "site"
    make_plugin_dist(site, "good", GOOD_SPEC, version="1.2")
    make_plugin_dist(site, "boom", "raise ImportError('no kernels')\n", version="0.3")
    out = lowlat(site, "plugins", "--json", "--device", "cpu", env_extra={"LOWLAT_PLUGINS": "good,boom,nvidia_mega"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    by_name = {p["name"]: p for p in report["plugins"]}
    assert by_name["boom"]["status"] == "broken" and "no kernels" in by_name["boom"]["error"]
    assert by_name["good"]["version"] == "1.2" and by_name["good"]["specs"][0]["guard"] == "pass"
    mega = by_name["nvidia_mega"]
    assert mega["distribution"] == "lowlat-nvidia-mega"
    assert {s["guard"] for s in mega["specs"]} == {"fail"}
    assert "needs platform cuda with capability >= 9.0" in mega["specs"][0]["reason"]
    assert "this machine: cpu" in mega["specs"][0]["reason"]


def test_plugins_table_and_explain(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    out = lowlat(site, "plugins", "--device", "cpu", env_extra={"LOWLAT_PLUGINS": "nvidia_mega,amd_mono"})
    assert out.returncode == 0, out.stderr
    assert "nvidia_mega" in out.stdout and "Qwen3MoeForCausalLM" in out.stdout and "guard here: fail" in out.stdout
    assert "loaded, guards pass here for 0 of 3 architectures" in out.stdout  # no bare "ok" beside failing guards
    # the platform reason all 3 architectures share is printed once per plugin, not once per architecture
    text = " ".join(out.stdout.split())
    assert text.count("guards fail here for all 3 architectures: platform: needs platform ") == 2, text
    assert text.count("this machine: cpu (Triton interpreter off)") == 2, text
    assert text.count("guard here: fail (as above)") == 6, text
    interp = {"LOWLAT_PLUGINS": "nvidia_mega", "TRITON_INTERPRET": "1"}
    out = lowlat(site, "plugins", "--device", "cpu", env_extra=interp)
    assert out.returncode == 0, out.stderr
    # --dtype auto is float32 on a CPU, which nvidia_mega refuses: a fail, as `lowlat run --plugin nvidia_mega` fails
    text = " ".join(out.stdout.split())
    assert "guards fail here for all 3 architectures: dtype: needs dtype bfloat16; the engine runs float32, what " \
           "--dtype auto computes in on a CPU (pass --dtype bfloat16) LlamaForCausalLM" in text, text
    assert text.count("needs dtype bfloat16;") == 1 and text.count("guard here: fail (as above)") == 3, text
    out = lowlat(site, "plugins", "--device", "cpu", "--dtype", "bf16", env_extra=interp)
    assert out.returncode == 0, out.stderr
    # requirements it could not check (no --model) are "not checked", never a "pass"
    text = " ".join(out.stdout.split())
    assert "guard here: pass" not in text
    assert "guards pass here for 0 of 3 architectures, not fully checked for 3" in text
    assert "guard here: not checked: model.head_dim, model.attention_bias, model.mlp_bias (no --model given); the " \
           "checked requirements pass" in text, text
    out = lowlat(site, "plugins", "--device", "cpu", "--dtype", "bf16", "--model", "tiny-qwen3", env_extra=interp)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert text.count("guard here: pass") == 1 and "(--model is a Qwen3ForCausalLM, not this architecture)" in text
    # a guard that passes where the plugin is not made for: auto leaves it out, and the row says how to run it
    assert "guard here: pass (auto leaves it out: made for cuda, not cpu; --plugin nvidia_mega runs it)" in text
    assert "made for cuda (--plugin auto takes it there only)" in text
    out = lowlat(site, "plugins", "--device", "cpu", "--dtype", "bf16", "--json", env_extra=interp)
    specs = json.loads(out.stdout)["plugins"][0]["specs"]
    assert {s["guard"] for s in specs} == {"not checked"} and "model.head_dim" in specs[0]["not_checked"]
    assert specs[0]["requirements"]["made_for"] == ["cuda"] and json.loads(out.stdout)["platform_kind"] == "cpu"
    out = lowlat(site, "plugins", "--device", "cpu", "--explain", "Qwen3ForCausalLM", "--dtype", "bfloat16",
                 env_extra={"LOWLAT_PLUGINS": "nvidia_mega", "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    assert "nvidia_mega (lowlat-nvidia-mega" in out.stdout and ": PASS" not in out.stdout
    assert ": NOT CHECKED (model.head_dim, model.attention_bias, model.mlp_bias skipped; the checked requirements " \
           "pass)" in out.stdout
    assert "[pass] platform: cpu (Triton interpreter on)" in out.stdout
    assert "[pass] architecture: Qwen3ForCausalLM" in out.stdout
    out = lowlat(site, "plugins", "--device", "cpu", "--explain", "Qwen3ForCausalLM", "--dtype", "bfloat16",
                 "--model", "tiny-qwen3", env_extra=interp)
    assert out.returncode == 0, out.stderr
    assert "nvidia_mega (lowlat-nvidia-mega 0" in out.stdout and ": PASS  coverage" in out.stdout, out.stdout


def _spec(arch, guard, *failures):
    trace = [{"requirement": "architecture", "status": "pass", "reason": arch}]
    trace += [{"requirement": r, "status": "fail", "reason": why} for r, why in failures]
    return {"architecture": arch, "coverage": "DECODE", "requirements": {
        "platforms": ["cuda"], "dtypes": ["bfloat16"], "tp_sizes": [1], "page_sizes": "any", "features_required": [],
        "features_refused": [], "libraries": [], "model": {}, "made_for": ["cpu"]}, "guard": guard,
        "not_checked": [],
        "reason": "; ".join(f"{r}: {why}" for r, why in failures) or "ok", "trace": trace}


def _table(capsys, *specs):
    from lowlat.cli.plugins import _print_table

    _print_table({"core_version": "0", "platform": "cpu", "platform_kind": "cpu", "model": None, "plugins": [{
        "name": "p", "distribution": "lowlat-p", "version": "1", "core_range": "(any)", "status": "ok", "error": None,
        "specs": list(specs)}]})
    return " ".join(capsys.readouterr().out.split())


def test_plugins_table_prints_a_shared_guard_failure_once(capsys):
    """A reason every architecture's guard fails with is printed once under the plugin; each architecture's row
    keeps what it adds (nothing is lost); without a reason shared by all, each row keeps its whole reason."""
    plat = ("platform", "needs platform cuda; this machine: cpu")
    text = _table(capsys, _spec("A", "fail", plat), _spec("B", "fail", plat, ("model.head_dim", "needs 64; has 96")),
                  _spec("C", "fail", ("dtype", "needs bfloat16"), plat))
    assert text.count("needs platform cuda") == 1, text
    assert "guards fail here for all 3 architectures: platform: needs platform cuda; this machine: cpu A " in text
    assert "A DECODE guard here: fail (as above)" in text
    assert "B DECODE guard here: fail (as above; also model.head_dim: needs 64; has 96)" in text
    assert "C DECODE guard here: fail (as above; also dtype: needs bfloat16)" in text
    text = _table(capsys, _spec("A", "fail", plat), _spec("B", "pass"))
    assert "guards fail here" not in text and "A DECODE guard here: fail (platform: needs platform cuda; " \
           "this machine: cpu)" in text and "B DECODE guard here: pass" in text, text
    text = _table(capsys, _spec("A", "fail", plat))  # one architecture: nothing to share
    assert "guards fail here" not in text and "A DECODE guard here: fail (platform: needs platform cuda" in text


def test_unknown_allowlisted_plugin_is_a_clear_cli_error(tmp_path):
    out = lowlat(tmp_path, "plugins", env_extra={"LOWLAT_PLUGINS": "nosuch"})
    assert out.returncode == 2
    assert "nosuch" in out.stderr and "found:" in out.stderr and "Traceback" not in out.stderr
