"""Child processes of the test process (Linux /proc): what the suite checks it leaves none of.

A module of its own, not conftest.py: a run that collects several test directories has several modules
named ``conftest``, so ``from conftest import ...`` would pick whichever came first.
"""

from __future__ import annotations

import os


def child_processes() -> list[tuple[int, str]]:
    """(pid, command name) of this process's live children, except multiprocessing's resource tracker.

    Reads /proc (Linux); elsewhere returns [] (nothing checked).
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == tracker:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == me and rest[0] != "Z":
            out.append((int(entry), name))
    return out


def wait_no_children(timeout_s: float = 10.0) -> list[tuple[int, str]]:
    """Poll until no child process is left or ``timeout_s`` s passed; returns those still there."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := child_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
