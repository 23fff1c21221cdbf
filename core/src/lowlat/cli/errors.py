"""One place that turns a subcommand's expected failures into one clear line and exit code 2."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any


def one_line_errors(command: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], int]]:
    """Decorate ``run(args)``: an exception prints ``lowlat COMMAND: error: Type: message`` to stderr and
    returns 2 (``LOWLAT_DEBUG=1`` re-raises for the traceback); otherwise the function's code (0 for None)."""

    def wrap(fn: Callable[[Any], Any]) -> Callable[[Any], int]:
        @functools.wraps(fn)
        def run(args: Any) -> int:
            try:
                return int(fn(args) or 0)
            except Exception as e:  # expected failures become one line
                if os.environ.get("LOWLAT_DEBUG") == "1":
                    raise
                print(f"lowlat {command}: error: {type(e).__name__}: {e}", file=sys.stderr)
                return 2

        return run

    return wrap
