"""``lowlat new-plugin``: the generated distribution passes its own kernel tests and the contract suite as written.

The generated directory is made importable the way ``pip install`` would: a dist-info written from its
``pyproject.toml`` (its entry point and its ``Requires-Dist: lowlat...`` line, so core's range check is the
real one) in a site dir, with that dir and its ``src`` on PYTHONPATH. The checks run in subprocesses, as a
vendor runs them.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from lowlat.cli import main
from lowlat.cli.new_plugin import next_steps
from lowlat.kit import FILES, lowlat_checkout, plugin_names, write_plugin
from packaging.requirements import Requirement
from packaging.version import Version

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


# -- the install lines: lowlat and lowlat-contract-tests are on no package index, so every command that installs the
#    plugin with its [test] extra must install both from a lowlat checkout in the same pip command.

CHECKOUT_VARS = ("$LOWLAT", "$RUNNER_TEMP/lowlat", "LOWLAT")  # how the README, the CI and the hint name a checkout


def install_lines(text: str) -> list[str]:
    """The ``pip install`` commands in ``text`` (a README, a workflow, the hint), one string each."""
    return [m.group(0).strip() for m in re.finditer(r"pip install [^\n#]*", text)
            if "torch" not in m.group(0).split()[2:3]]


def unindexed_gaps(line: str, plugin: Path, checkout: Path, *, wants: set[str],
                   installed: frozenset[str] = frozenset()) -> list[str]:
    """What ``line`` (``pip install ...``) leaves to a package index that has none of lowlat's distributions.

    ``wants``: the lowlat distributions that must end up installed (the plugin's own requirements on them count
    too); ``installed``: those the environment has already (not looked up). Each ``-e PATH`` is read from its
    pyproject (checkout variables become ``checkout``, ``.`` the plugin), ``--find-links CHECKOUT/dist`` stands
    for the checkout's ``nox -s build`` wheels. An empty list: every one is provided by a local path, at a
    version its requirement accepts.
    """
    words = shlex.split(line.rstrip("`."))[2:]
    provided: dict[str, Version] = {}
    required: dict[str, Requirement] = {}
    problems = []
    for i, w in enumerate(words):
        if w.startswith("-"):
            continue
        flag = words[i - 1] if i > 0 else ""
        raw, extras = (w.split("[", 1) + [""])[:2]
        for var in CHECKOUT_VARS:
            if raw.startswith(var + "/"):
                raw = str(checkout) + raw[len(var):]
        path = plugin if raw == "." else Path(raw)
        if flag == "--find-links":  # the checkout's `nox -s build` wheels: core, the suite and the vendors
            if path == checkout / "dist":
                for d in ("core", "contract_tests"):
                    project = tomllib.loads((checkout / d / "pyproject.toml").read_text())["project"]
                    provided[project["name"]] = Version(project["version"])
            continue
        if flag != "-e" or not (path / "pyproject.toml").is_file():
            if w.startswith("lowlat"):
                problems.append(f"{w}: not on a package index")
            continue
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        provided[project["name"]] = Version(project["version"])
        reqs = list(project.get("dependencies", []))
        for extra in filter(None, extras.rstrip("]").split(",")):
            reqs += project.get("optional-dependencies", {}).get(extra, [])
        for r in map(Requirement, reqs):
            if r.name.startswith("lowlat"):
                required[r.name] = r
    for name in sorted((wants | set(required)) - installed):
        if name not in provided:
            problems.append(f"{name}: no -e path of the command provides it")
        elif name in required and not required[name].specifier.contains(provided[name], prereleases=True):
            problems.append(f"{name}: {provided[name]} does not satisfy {required[name]}")
    return problems


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen") / "lowlat-acme"
    write_plugin("acme", root)
    return root


@pytest.fixture(scope="module")
def checkout():
    root = lowlat_checkout()
    if root is None:
        pytest.skip("core is not installed from a lowlat checkout")
    return root


def test_generated_install_lines_work_from_a_checkout(generated, checkout):
    suite = {"lowlat", "lowlat-contract-tests"}
    readme = (generated / "README.md").read_text()
    ci = (generated / ".github" / "workflows" / "contract.yml").read_text()
    for where, text in (("README.md", readme), ("contract.yml", ci)):
        lines = [ln for ln in install_lines(text) if ".[test]" in ln]
        assert lines, f"{where} has no pip install of the plugin with its [test] extra"
        for ln in lines:
            assert unindexed_gaps(ln, generated, checkout, wants=suite) == [], (where, ln)
    hint = [ln for ln in install_lines("\n".join(next_steps("acme", generated, checkout))) if "pytest" in ln]
    assert hint and unindexed_gaps(hint[0], generated, checkout, wants={"lowlat-contract-tests"},
                                       installed=frozenset({"lowlat"})) == [], hint  # the hint's core: running
    assert str(checkout / "contract_tests") in hint[0]  # the exact path, not a placeholder
    assert "LOWLAT/contract_tests" in "\n".join(next_steps("acme", generated, None))  # a wheel: named, explained
    ref = re.search(r'LOWLAT_REF: "([^"]+)"', ci).group(1)
    assert re.fullmatch(r"[0-9a-f]{40}|v\d+\.\d+\.\d+\S*", ref), ref


@pytest.mark.parametrize("line, gap", [
    ('pip install -e ".[test]"', "lowlat-contract-tests: no -e path"),  # what the kit wrote before
    ("pip install lowlat-contract-tests", "not on a package index"),
    ('pip install --find-links /tmp/elsewhere -e ".[test]"', "lowlat-contract-tests: no -e path"),
    ('pip install -e "$LOWLAT/core" -e ".[test]"', "lowlat-contract-tests: no -e path"),
    ('pip install -e "$LOWLAT/no_such_dir" -e "$LOWLAT/contract_tests" -e ".[test]"', "lowlat: no -e path"),
])
def test_the_install_check_rejects_lines_that_need_an_index(generated, checkout, line, gap):
    gaps = unindexed_gaps(line, generated, checkout, wants={"lowlat", "lowlat-contract-tests"})
    assert any(gap in g for g in gaps), gaps


def test_the_install_check_rejects_a_checkout_outside_the_core_range(generated, checkout, tmp_path):
    old = tmp_path / "old"
    for d, name in (("core", "lowlat"), ("contract_tests", "lowlat-contract-tests")):
        (old / d).mkdir(parents=True)
        (old / d / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.2.1"\n')
    line = 'pip install -e "$LOWLAT/core" -e "$LOWLAT/contract_tests" -e ".[test]"'
    assert any("does not satisfy" in g for g in unindexed_gaps(line, generated, old, wants={"lowlat"}))


def test_generated_install_line_resolves_with_no_index(generated, checkout):
    """The README's line, run by pip with no package index at all (dry run): lowlat's distributions come from the
    checkout, everything else is already installed here."""
    pytest.importorskip("setuptools")
    line = next(ln for ln in install_lines((generated / "README.md").read_text()) if ".[test]" in ln)
    args = [w.replace("$LOWLAT", str(checkout)) for w in shlex.split(line)[2:]]
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                          *args], cwd=generated, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "lowlat-acme" in out.stdout


def test_generated_triton_range_is_the_supported_one(generated):
    deps = tomllib.loads((generated / "pyproject.toml").read_text())["project"]["dependencies"]
    triton = next(Requirement(d) for d in deps if d.startswith("triton"))
    assert str(triton.specifier) == "<3.10,>=3.6"
    specs = (generated / "src" / "lowlat_acme" / "specs.py").read_text()
    assert '("triton", ">=3.6,<3.10")' in specs
    assert all(triton.specifier.contains(v) for v in ("3.6.0", "3.9.1")) and not triton.specifier.contains("3.10.0")
