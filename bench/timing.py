"""Timing the benchmarks share: plain Python, so that the core's benchmarks import nothing else."""

from __future__ import annotations

import time


def best_of(repeats: int, function) -> float:
    """The fastest of ``repeats`` runs of ``function``, in seconds: the least disturbed by the
    other work of a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best
