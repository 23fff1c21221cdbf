"""``lowlat new-plugin``: the generated distribution passes its own kernel tests and the contract suite as written.

The generated directory is made importable the way ``pip install`` would: a dist-info written from its
``pyproject.toml`` (its entry point and its ``Requires-Dist: lowlat...`` line, so core's range check is the
real one) in a site dir, with that dir and its ``src`` on PYTHONPATH. The checks run in subprocesses, as a
vendor runs them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from lowlat.cli import main
from lowlat.kit import FILES, plugin_names, write_plugin

QUICK = "guard or output_convention or logits_match or kv_writes"  # the contract suite's quick subset


def install_like_pip(root: Path, site: Path) -> None:
    """A dist-info for the generated distribution (name, version, dependencies, entry points from pyproject)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    meta += [f"Requires-Dist: {d}" for d in project["dependencies"]]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    eps = project["entry-points"]["lowlat.plugins"]
    (info / "entry_points.txt").write_text("[lowlat.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    (info / "RECORD").write_text("")


def test_new_plugin_writes_every_file(tmp_path, capsys):
    assert main(["new-plugin", "acme_fast", "--dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    names = plugin_names("acme_fast")
    for rel in FILES:
        assert (tmp_path / "d" / rel.replace("@PKG@", names.package)).is_file(), rel
    assert "--lowlat-plugin acme_fast" in out
    project = tomllib.loads((tmp_path / "d" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "lowlat-acme-fast"
    assert project["entry-points"]["lowlat.plugins"] == {"acme_fast": "lowlat_acme_fast"}
    assert names.core_requirement in project["dependencies"]
    build = (tmp_path / "d" / "src" / "lowlat_acme_fast" / "build.py").read_text()
    assert "class AcmeFastStep(ReferenceStep)" in build and "@" not in build.replace("@triton", "")
    for py in (tmp_path / "d").rglob("*.py"):
        outside = core_imports_outside_the_api(py.read_text())
        assert not outside, f"{py.name} imports {outside}: a plugin imports lowlat.plugin only"


def core_imports_outside_the_api(source: str) -> list[str]:
    """The lowlat modules ``source`` imports other than ``lowlat.plugin`` (the whole vendor API)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [n for n in names if n.split(".")[0] == "lowlat" and n != "lowlat.plugin"]
    return found


def test_the_import_check_finds_core_internals():
    assert core_imports_outside_the_api("from lowlat.plugin.reference_step import rms\nimport lowlat.config") == [
        "lowlat.plugin.reference_step", "lowlat.config"]
    assert core_imports_outside_the_api("from lowlat.plugin import Coverage\nfrom . import x\nimport lowlatx") == []


def test_core_range_is_the_running_minor_series():
    assert plugin_names("x", "0.3.0").core_requirement == "lowlat>=0.3,<0.4"
    assert plugin_names("x", "1.12.4.dev0").core_requirement == "lowlat>=1.12,<1.13"


@pytest.mark.parametrize("bad", ["Acme", "1acme", "acme-fast", "", "a" * 41])
def test_new_plugin_refuses_a_bad_name(bad):
    with pytest.raises(ValueError, match="lower-case identifier"):
        plugin_names(bad)


def test_new_plugin_refuses_a_non_empty_dir(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["new-plugin", "acme", "--dir", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    write_plugin("acme", tmp_path, force=True)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_generated_plugin_passes_its_tests_and_the_contract_suite(tmp_path):
    root, site = tmp_path / "lowlat-acme", tmp_path / "site"
    write_plugin("acme", root)
    install_like_pip(root, site)
    path = [str(site), str(root / "src"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("LOWLAT_PLUGINS", None)
    pytest_cmd = [sys.executable, "-m", "pytest"]
    own = subprocess.run([*pytest_cmd, "-q", "-p", "no:cacheprovider", "tests"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-2000:]
    contract = subprocess.run([*pytest_cmd, "-q", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract",
                               "--lowlat-plugin", "acme", "-k", QUICK], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert contract.returncode == 0, contract.stdout[-4000:] + contract.stderr[-2000:]
    assert "FAIL " not in contract.stdout and "PASS  kv_writes" in contract.stdout, contract.stdout[-3000:]
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in contract.stdout, f"{arch} was not checked"
