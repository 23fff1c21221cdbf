"""The out-of-tree vendor of compat_matrix.toml (lowlat-swiglu, kept as examples/lowlat-swiglu.bundle).

At the commit its ``[[vendor]]`` entry pins (exported from the bundle as ``nox -s contract`` exports it, never
from a working tree): the plugin is one ReferenceStep stage in under 40 lines of code, its pyproject matches
the entry, its own tests and the contract suite's quick subset pass, and the matrix's ``[[tested]]`` row for
it records that commit. A deliberately broken copy of its kernel fails the same quick subset.
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import tomllib
from lowlat_contract.checkout import export_tree
from lowlat_contract.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[2]
NAME = "lowlat-swiglu"
QUICK = "guard or output_convention or logits_match or kv_writes"  # the contract suite's quick subset


def code_lines(text: str) -> int:
    """Lines holding code: no blank lines, comments or docstrings (module, class, function)."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))  # type: ignore[operator]
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in skip}
    return len(lines - docs)


@pytest.fixture(scope="module")
def vendor(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(matrix entry, exported tree at its commit, a site dir where it is installed as pip would)."""
    entry = next(v for v in load_matrix(ROOT / "compat_matrix.toml").vendors if v.name == NAME)
    tmp = tmp_path_factory.mktemp("oot")
    tree = export_tree(ROOT, entry.path, entry.commit, tmp / "scratch", repo=entry.repo)
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    info = tmp / "site" / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    (info / "METADATA").write_text("\n".join(meta + [f"Requires-Dist: {d}" for d in project["dependencies"]]) + "\n")
    eps = project["entry-points"]["lowlat.plugins"]
    (info / "entry_points.txt").write_text("[lowlat.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    (info / "RECORD").write_text("")
    return entry, tree, tmp / "site"


def _env(*path: Path) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([*map(str, path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("LOWLAT_PLUGINS", None)
    return env


def _quick_contract(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract",
           "--lowlat-plugin", "swiglu", "-k", QUICK]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_counter_counts_code_and_only_code():
    text = '"""doc\nmore"""\n\n# comment\nx = (1,\n     2)\n\n\ndef f():\n    """doc"""\n    return x  # why\n'
    assert code_lines(text) == 4
    assert code_lines(text + "y = 1\n" * 40) == 44


def test_the_pinned_commit_is_one_stage_in_under_40_lines(vendor):
    entry, tree, _ = vendor
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    assert (project["name"], project["version"]) == (entry.name, entry.version)
    assert project["entry-points"]["lowlat.plugins"] == {entry.plugin: "lowlat_swiglu"}
    sources = sorted((tree / "src").rglob("*.py"))
    assert [p.name for p in sources] == ["__init__.py"], sources
    text = sources[0].read_text()
    assert "(ReferenceStep):" in text and "    def mlp(self" in text and "@triton.jit" in text
    assert code_lines(text) < 40, f"{code_lines(text)} code lines"


def test_the_matrix_row_records_the_pinned_commit(vendor):
    entry, _, _ = vendor
    rows = [t for t in load_matrix(ROOT / "compat_matrix.toml").tested
            if (t.vendor, t.vendor_version, t.platform) == (entry.name, entry.version, "cpu-interpreter")]
    assert rows, f"no [[tested]] row for {entry.name} {entry.version}: run nox -s contract -k swiglu -- --update"
    assert {t.vendor_commit for t in rows} == {entry.commit}
    assert any(t.result == "pass" for t in rows)


def test_its_own_tests_and_the_quick_contract_pass_at_the_pinned_commit(vendor):
    _, tree, site = vendor
    env = _env(site, tree / "src")
    own = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-2000:]
    done = _quick_contract(site.parent, env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASS  kv_writes" in done.stdout and "FAIL " not in done.stdout, done.stdout[-3000:]


def test_a_broken_kernel_fails_the_quick_contract(vendor, tmp_path):
    _, tree, site = vendor
    broken = tmp_path / "src" / "lowlat_swiglu"
    broken.mkdir(parents=True)
    text = (tree / "src" / "lowlat_swiglu" / "__init__.py").read_text()
    assert "tl.exp(-gf)" in text
    (broken / "__init__.py").write_text(text.replace("tl.exp(-gf)", "tl.exp(gf)"))  # silu(x) -> x * sigmoid(-x)
    done = _quick_contract(tmp_path, _env(site, tmp_path / "src"))
    assert done.returncode != 0 and "FAIL  forward_outputs" in done.stdout, done.stdout[-3000:]
