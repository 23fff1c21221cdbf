"""Render the plugin templates for one name: a distribution ``lowlat-NAME`` with the package ``lowlat_NAME``.

Every template is a plain file in ``templates/``; ``@NAME@``, ``@PKG@``, ``@DIST@``, ``@CLASS@``, ``@CORE_REQ@``,
``@CORE_VERSION@`` and ``@LOWLAT_REF@`` are replaced (no other syntax, so Python, TOML and YAML stay as they
read). The core range is this core's minor series (``lowlat>=0.3,<0.4`` for 0.3.x): what the plugin is generated
against. lowlat is not on a package index, so the generated README and CI install core and the contract suite
from a lowlat checkout; ``@LOWLAT_REF@`` is the commit of the checkout this core runs from (``lowlat_checkout``),
else the tag ``vVERSION``.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packaging.version import Version

FILES: dict[str, str] = {
    "pyproject.toml": "pyproject.toml.tmpl",
    "README.md": "README.md.tmpl",
    "CHANGELOG.md": "CHANGELOG.md.tmpl",
    ".github/workflows/contract.yml": "ci.yml.tmpl",
    "src/@PKG@/__init__.py": "init.py.tmpl",
    "src/@PKG@/specs.py": "specs.py.tmpl",
    "src/@PKG@/build.py": "build.py.tmpl",
    "src/@PKG@/kernels/__init__.py": "kernels_init.py.tmpl",
    "src/@PKG@/kernels/rmsnorm.py": "rmsnorm.py.tmpl",
    "tests/conftest.py": "conftest.py.tmpl",
    "tests/test_rmsnorm.py": "test_rmsnorm.py.tmpl",
}
"""Generated path (placeholders allowed) -> template file in ``lowlat/kit/templates``."""

NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True)
class PluginNames:
    """The names derived from a plugin name: ``name`` (``--plugin``), ``package``, ``distribution``, ``cls``."""

    name: str
    package: str
    distribution: str
    cls: str
    core_requirement: str
    core_version: str
    lowlat_ref: str = ""

    def substitutions(self) -> dict[str, str]:
        return {"@NAME@": self.name, "@PKG@": self.package, "@DIST@": self.distribution, "@CLASS@": self.cls,
                "@CORE_REQ@": self.core_requirement, "@CORE_VERSION@": self.core_version,
                "@LOWLAT_REF@": self.lowlat_ref or f"v{self.core_version}"}


def lowlat_checkout() -> Path | None:
    """The root of the lowlat source checkout this core runs from (an editable install), or None (a wheel).

    A root holds ``core/pyproject.toml`` and ``contract_tests/pyproject.toml``: the two directories a plugin's
    environment installs lowlat and ``lowlat-contract-tests`` from (neither is on a package index).
    """
    import lowlat

    root = Path(lowlat.__file__).resolve().parents[3]  # ROOT/core/src/lowlat/__init__.py
    ok = all((root / d / "pyproject.toml").is_file() for d in ("core", "contract_tests"))
    return root if ok else None


def checkout_commit(root: Path | None) -> str:
    """``git rev-parse HEAD`` of ``root`` ("" when it is None, not a git work tree, or git is missing)."""
    if root is None:
        return ""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    ref = out.stdout.strip()
    return ref if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", ref) else ""


def plugin_names(name: str, core_version: str | None = None, lowlat_ref: str = "") -> PluginNames:
    """The names of plugin ``name``; ``lowlat_ref``: the lowlat commit or tag its CI checks out ("" -> ``vVERSION``).

    Raises:
        ValueError: ``name`` is not a lower-case Python identifier of at most 40 characters.
    """
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"plugin name {name!r} must be a lower-case identifier (letters, digits, '_'; starting "
                         f"with a letter; at most 40 characters), e.g. 'myvendor'")
    if core_version is None:
        from lowlat.runtime.plugin_host.discovery import core_version as running

        core_version = running()
    v = Version(core_version)
    req = f"lowlat>={v.major}.{v.minor},<{v.major}.{v.minor + 1}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    return PluginNames(name, f"lowlat_{name}", f"lowlat-{name.replace('_', '-')}", cls, req, core_version,
                       lowlat_ref)


def write_plugin(name: str, dest: str | Path | None = None, *, force: bool = False,
                 core_version: str | None = None) -> list[Path]:
    """Write the distribution of plugin ``name`` into ``dest`` (default ``./lowlat-NAME``).

    Its CI checks lowlat out at the commit of this core's checkout (``checkout_commit``); with an explicit
    ``core_version`` (tests), or a core installed from a wheel, at the tag ``vVERSION``.

    Returns:
        The files written, in FILES order.
    Raises:
        ValueError: a malformed name.
        FileExistsError: ``dest`` holds files already (pass ``force`` to overwrite the generated ones).
    """
    names = plugin_names(name, core_version, checkout_commit(lowlat_checkout()) if core_version is None else "")
    root = Path(dest) if dest is not None else Path.cwd() / names.distribution
    if root.exists() and any(root.iterdir()) and not force:
        raise FileExistsError(f"{root} is not empty; choose another --dir or pass --force to overwrite")
    subs = names.substitutions()
    templates = resources.files("lowlat.kit") / "templates"
    written = []
    for rel, template in FILES.items():
        text = (templates / template).read_text(encoding="utf-8")
        for key, value in subs.items():
            rel, text = rel.replace(key, value), text.replace(key, value)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
