"""Source trees of the releases in compat_matrix.toml, at their recorded commits, for ``nox -s contract``.

A ``[[vendor]]`` entry names its source as ``path`` inside ``repo``: ``repo`` empty means this repository
(``path`` is then relative to its root); otherwise ``repo`` is another git repository: a local directory, a git
bundle file (``git bundle create F --all``; examples/lowlat-swiglu.bundle is one) or a URL git can clone, a
relative ``repo`` being relative to this repository's root. With ``commit`` set, the tree is exported from that
commit with ``git archive`` (never read from a working tree, so the recorded result belongs to the recorded
commit); with ``commit`` empty the working tree of this repository is used (the version in development), and an
out-of-tree vendor must pin a commit. Imports nothing heavy (noxfile.py loads it from the source tree).
"""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path


class CheckoutError(RuntimeError):
    """A release's source could not be exported; the message carries git's own error text."""


def _git(args: list[str], cwd: Path | None = None) -> bytes:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False, timeout=600)
    except subprocess.TimeoutExpired:
        raise CheckoutError(f"`git {' '.join(args)}` did not finish in 600 s") from None
    if done.returncode != 0:
        where = f" in {cwd}" if cwd else ""
        raise CheckoutError(f"`git {' '.join(args)}`{where} failed (exit {done.returncode}): "
                            f"{done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def _repo_dir(repo: str, root: Path, cache: Path, commit: str) -> Path:
    """A local git directory holding ``commit`` of ``repo``: the directory itself, or a bare clone under ``cache``
    of a git bundle file or a URL (fetched again when an earlier clone lacks ``commit``)."""
    local = Path(repo).expanduser()
    if not local.is_absolute():
        local = root / local
    if local.is_dir():
        return local
    if local.is_file():
        source = str(local)  # a git bundle (`git bundle create F --all`); git says so when it is not one
    elif "://" in repo or repo.startswith("git@"):
        source = repo
    else:
        raise CheckoutError(f"vendor repo {repo!r} is neither a directory, a git bundle file nor a git URL "
                            f"(looked for {local})")
    dest = cache / ("clone-" + hashlib.sha1(source.encode()).hexdigest()[:12])
    if not (dest / "HEAD").exists():
        _git(["clone", "--quiet", "--bare", source, str(dest)])
    elif not _has_commit(dest, commit):
        _git(["fetch", "--quiet", source, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"], cwd=dest)
    return dest


def _has_commit(git_dir: Path, commit: str) -> bool:
    done = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=git_dir, capture_output=True,
                          check=False)
    return done.returncode == 0


def export_tree(root: str | Path, path: str, commit: str, dest: str | Path, *, repo: str = "") -> Path:
    """The directory holding ``path`` of ``repo`` (default: the repository at ``root``) at ``commit``.

    Args:
        root: this repository's root (where compat_matrix.toml lies).
        path: the source directory inside the repository, relative (``vendors/nvidia_mega``; ``.`` for the root).
        commit: a commit id; empty for the working tree of ``root`` (only when ``repo`` is empty).
        dest: a scratch directory; trees are exported under ``dest/<commit[:12]>``.
        repo: another repository (a directory, a git bundle file or a URL); empty for ``root``.
    Raises:
        CheckoutError: ``path`` is absolute or leaves the repository, an out-of-tree vendor has no commit,
            or git fails (its error text is in the message), or the commit lacks ``path``.
    """
    root, dest = Path(root).resolve(), Path(dest)
    rel = Path(path)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckoutError(f"path {path!r} must be relative to its repository and stay inside it; put the other "
                            "repository in `repo` and the directory inside it in `path`")
    if not commit:
        if repo:
            raise CheckoutError(f"vendor repo {repo!r} has no commit: an out-of-tree vendor is tested at a pinned "
                                "commit (set `commit`)")
        return root / rel
    source = _repo_dir(repo, root, dest, commit) if repo else root
    out = dest / commit[:12] / (hashlib.sha1(repo.encode()).hexdigest()[:8] if repo else "here")
    target = out / rel
    if not target.exists():
        archive = _git(["archive", "--format=tar", commit, "--", path], cwd=source)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(out, filter="data")
            else:  # pragma: no cover - Python before 3.10.12
                tar.extractall(out)  # noqa: S202 - git archive of a commit we name
        if not target.exists():
            raise CheckoutError(f"commit {commit} of {repo or root} has no {path!r}")
    return target


def vendor_dependencies(pyproject: str | Path) -> list[str]:
    """The vendor's own ``[project] dependencies`` from its pyproject.toml, without core (``lowlat``) itself.

    Core is installed separately at the version under test, so the vendor is installed with ``--no-deps``
    (a pair that core must refuse has to reach core's discovery) and its other dependencies from this list.
    """
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    from packaging.requirements import Requirement

    deps = tomllib.loads(Path(pyproject).read_text()).get("project", {}).get("dependencies", [])
    return [d for d in deps if Requirement(d).name.lower().replace("_", "-") != "lowlat"]
