"""A launch config's fields from an environment variable: the B side of a whole-step A/B.

``LOWLAT_MEGA_MOE_CONFIG`` (``moe.MoEKernelConfig``) and ``LOWLAT_MEGA_LM_HEAD_CONFIG`` (``lm_head.LMHeadConfig``)
hold ``FIELD=INT`` items separated by commas, e.g. ``down_block_n=32,down_warps=4``; on/off fields take 1 or 0. The
engine reads the config once at build, so ``AB_ENV=NAME=VALUE python3 bench/gpu_jobs.py mega-ab`` times a config
change in whole steps beside the default (docs/kernels.md, "Launch plans").
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import Field, fields
from typing import TypeVar

C = TypeVar("C")


def is_flag(f: Field) -> bool:
    """Whether a config dataclass field is on/off (its annotation a string under ``from __future__ import
    annotations``)."""
    return f.type in (bool, "bool")


def config_from_env(cls: type[C], env: str) -> C:
    """``cls()`` with the fields that the variable ``env`` names replaced.

    Args:
        cls: a frozen dataclass whose fields are ints or bools, each with a default; its ``__post_init__`` checks
            values. env: the variable's name (unset or blank: the defaults).

    Raises:
        ValueError: an empty item, a repeated field, an item that is not ``FIELD=INT`` with a field of ``cls``, a
            value that is not a plain decimal integer (ASCII digits, an optional minus; not ``+8``, ``0x8``, ``1_6``
            or other scripts' digits), or not 1 / 0 for an on/off field, or one ``cls`` refuses; each names the
            variable and the item (cut to 60 characters).
    """
    text = os.environ.get(env, "").strip()
    if not text:
        return cls()
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    changes: dict[str, object] = {}
    for item in text.split(","):
        name, eq, value = (part.strip() for part in item.partition("="))
        shown = repr(item.strip()[:60] + ("..." if len(item.strip()) > 60 else ""))
        if not item.strip():
            raise ValueError(f"{env}={text!r} has an empty item: separate FIELD=INT items by single commas")
        if name in changes:
            raise ValueError(f"{env}={text!r} sets {name} twice: keep one")
        if not eq or name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{env}: {shown} must be FIELD=INT with a {cls.__name__} field{hint}: "
                             f"{', '.join(names)}")
        flag = is_flag(names[name])
        if flag and value not in ("0", "1"):
            raise ValueError(f"{env}: {shown}: {name} is 1 (on) or 0 (off)")
        if re.fullmatch(r"-?[0-9]{19,}", value):
            raise ValueError(f"{env}: {shown}: the value has more than 18 digits, far outside any field's range")
        if not re.fullmatch(r"-?[0-9]{1,18}", value):
            sep = "; separate items with ',' not ';'" if ";" in value else ""
            raise ValueError(f"{env}: {shown}: the value must be a decimal integer such as 8{sep}")
        number = int(value)
        changes[name] = bool(number) if flag else number
    try:
        return cls(**changes)
    except ValueError as err:
        raise ValueError(f"{env}={text[:120]!r}: {err}") from None
