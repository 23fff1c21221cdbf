"""Progress bars (rich, on stderr, cleared when done) for weight loading and CUDA-graph capture."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


@contextlib.contextmanager
def task_progress(description: str, total: int, *, enabled: bool, bytes_unit: bool = False
                  ) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n=1)``; shows a transient rich progress bar of ``total`` units when ``enabled``.

    With ``bytes_unit`` the bar counts bytes (total size, transfer speed).
    """
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if bytes_unit else [MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def weights_with_progress(weights: Iterable[tuple[str, torch.Tensor]], *, total_bytes: int, elem_size: int,
                          enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``(name, tensor)`` pairs through, advancing a bar by each tensor's checkpoint bytes.

    Args:
        total_bytes: the checkpoint's size in bytes (the bar's total).
        elem_size: bytes per element in the checkpoint (tensors may arrive cast to another dtype).
    """
    with task_progress("loading weights", total_bytes, enabled=enabled, bytes_unit=True) as advance:
        for name, tensor in weights:
            yield name, tensor
            advance(tensor.numel() * elem_size)
