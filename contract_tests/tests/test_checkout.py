"""checkout.py: releases are exported from their recorded commit, never read from a working tree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from lowlat_contract.checkout import CheckoutError, export_tree, vendor_dependencies


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def vendor_repo(tmp_path: Path) -> tuple[Path, str]:
    """An out-of-tree vendor repository with one commit, whose working tree then changes."""
    repo = tmp_path / "vendor-repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "version.txt").write_text("committed\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "release")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "version.txt").write_text("edited after the release\n")
    return repo, commit


def test_out_of_tree_vendor_is_exported_at_its_commit_not_its_working_tree(tmp_path, vendor_repo):
    repo, commit = vendor_repo
    tree = export_tree(tmp_path / "here", "pkg", commit, tmp_path / "scratch", repo=str(repo))
    assert (tree / "version.txt").read_text() == "committed\n"
    assert repo not in tree.parents


def test_absolute_path_with_a_commit_is_refused(tmp_path, vendor_repo):
    repo, commit = vendor_repo
    with pytest.raises(CheckoutError, match="must be relative"):
        export_tree(tmp_path, str(repo / "pkg"), commit, tmp_path / "scratch")


def test_path_leaving_the_repository_is_refused(tmp_path, vendor_repo):
    _, commit = vendor_repo
    with pytest.raises(CheckoutError, match="stay inside"):
        export_tree(tmp_path, "../vendor-repo/pkg", commit, tmp_path / "scratch")


def test_out_of_tree_vendor_without_a_commit_is_refused(tmp_path, vendor_repo):
    repo, _ = vendor_repo
    with pytest.raises(CheckoutError, match="pinned commit"):
        export_tree(tmp_path, "pkg", "", tmp_path / "scratch", repo=str(repo))


def test_unknown_commit_shows_gits_error(tmp_path, vendor_repo):
    repo, _ = vendor_repo
    with pytest.raises(CheckoutError, match=r"git archive.*failed.*fatal: "):
        export_tree(tmp_path, "pkg", "0" * 40, tmp_path / "scratch", repo=str(repo))


def test_commit_without_the_path_is_an_error(tmp_path, vendor_repo):
    repo, commit = vendor_repo
    with pytest.raises(CheckoutError, match="failed|has no"):
        export_tree(tmp_path, "elsewhere", commit, tmp_path / "scratch", repo=str(repo))


def test_working_tree_of_this_repository_for_a_version_in_development(tmp_path):
    assert export_tree(tmp_path, "vendors/x", "", tmp_path / "scratch") == tmp_path.resolve() / "vendors/x"


def test_vendor_dependencies_leave_core_out(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "v"\ndependencies = ["lowlat>=0.2,<0.3", "triton>=3.6", "numpy"]\n')
    assert vendor_dependencies(tmp_path / "pyproject.toml") == ["triton>=3.6", "numpy"]


def test_bundle_is_cloned_and_exported_at_its_commit(tmp_path, vendor_repo):
    repo, commit = vendor_repo
    bundle = tmp_path / "vendor.bundle"
    _git(repo, "bundle", "create", str(bundle), "--all")
    tree = export_tree(tmp_path, "pkg", commit, tmp_path / "scratch", repo="vendor.bundle")  # relative to root
    assert (tree / "version.txt").read_text() == "committed\n"


def test_a_newer_bundle_refreshes_the_earlier_clone(tmp_path, vendor_repo):
    repo, first = vendor_repo
    bundle, scratch = tmp_path / "vendor.bundle", tmp_path / "scratch"
    _git(repo, "bundle", "create", str(bundle), "--all")
    export_tree(tmp_path, "pkg", first, scratch, repo=str(bundle))
    _git(repo, "commit", "-qam", "second release")
    second = _git(repo, "rev-parse", "HEAD")
    _git(repo, "bundle", "create", str(bundle), "--all")
    tree = export_tree(tmp_path, "pkg", second, scratch, repo=str(bundle))
    assert (tree / "version.txt").read_text() == "edited after the release\n"


def test_a_file_that_is_no_bundle_shows_gits_error(tmp_path, vendor_repo):
    _, commit = vendor_repo
    (tmp_path / "not.bundle").write_text("hello\n")
    with pytest.raises(CheckoutError, match=r"git clone.*failed.*(bundle|repository)"):
        export_tree(tmp_path, "pkg", commit, tmp_path / "scratch", repo="not.bundle")


def test_a_missing_repo_is_named(tmp_path, vendor_repo):
    _, commit = vendor_repo
    with pytest.raises(CheckoutError, match=r"neither a directory, a git bundle file nor a git URL.*gone\.bundle"):
        export_tree(tmp_path, "pkg", commit, tmp_path / "scratch", repo="gone.bundle")
