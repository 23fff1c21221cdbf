"""``--model`` resolution the way the HF ecosystem does it: a directory, a preset, or a repo id in the local cache.

A repo id (``org/name``, optionally ``org/name@revision``) is looked up offline in huggingface_hub's cache
(``HF_HUB_CACHE`` / ``HF_HOME``; ``snapshot_download(local_files_only=True)``); nothing is downloaded. When the
repo is not cached the error names the cache directory and the command that fetches it.
"""

from __future__ import annotations

from pathlib import Path

from lowlat.config import ConfigError


def looks_like_repo_id(model: str) -> bool:
    """``org/name`` (one slash, no leading ``/``, ``.`` or ``~``) that is not an existing path."""
    if model.startswith(("/", ".", "~")) or Path(model).exists():
        return False
    name = model.split("@", 1)[0]
    parts = name.split("/")
    return len(parts) == 2 and all(parts)


def resolve_model_path(model: str, *, cache_dir: str | None = None) -> str:
    """What EngineConfig.model should be for ``model``: directories and presets unchanged, repo ids their snapshot.

    ``cache_dir``: the hub cache to look in (default: huggingface_hub's, from HF_HUB_CACHE / HF_HOME).

    Raises:
        ConfigError: ``model`` is a repo id that is not in the local HF cache (or huggingface_hub is missing).
    """
    from lowlat.loader.presets import PRESETS

    if model in PRESETS or not looks_like_repo_id(model):
        return model
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a core dependency
        raise ConfigError(f"model {model!r} looks like an HF repo id but huggingface_hub is not installed; "
                          "pip install huggingface_hub, or pass a checkpoint directory") from None
    repo, _, revision = model.partition("@")
    try:
        path = snapshot_download(repo, revision=revision or None, local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        from lowlat.loader.presets import closest_preset

        close = closest_preset(model)
        raise ConfigError(
            f"model {model!r} is not a directory, a preset, or a repo in the local HF cache "
            f"({cache_dir or constants.HF_HUB_CACHE}); fetch it with `hf download {repo}` (or "
            f"`huggingface-cli download {repo}`), or pass a checkpoint directory"
            + (f" (or did you mean the preset {close!r}?)" if close else "")) from None
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"the cached snapshot of {model!r} at {path} has no config.json; is it a model repo? "
                          f"Re-fetch it with `hf download {repo}`")
    return str(path)
