"""Where a request's time went: named steps in microseconds, as placement answers (``timings_us``)
and served sessions report them. The clock is passed in (monotonic seconds), like every clock
of the core."""

from __future__ import annotations

import time
from collections.abc import Callable


class StepTimer:
    """Microseconds spent in each step: ``lap(step)`` closes the step that began at the last lap
    (or at the start)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._last = clock()
        self.spent: dict[str, int] = {}

    def lap(self, step: str) -> int:
        now = self._clock()
        self.spent[step] = self.spent.get(step, 0) + round((now - self._last) * 1e6)
        self._last = now
        return self.spent[step]

    def add(self, step: str, microseconds: int) -> None:
        """A step measured elsewhere (on another clock, or before this timer started)."""
        self.spent[step] = self.spent.get(step, 0) + max(int(microseconds), 0)


def check_timings(value: object, what: str = "timings_us", *, max_steps: int = 32) -> dict:
    """A ``timings_us`` member as another party sent it: an object of at most ``max_steps``
    step names (ASCII, 1 to 64 characters) to non-negative integers. ValueError otherwise."""
    if not isinstance(value, dict) or len(value) > max_steps:
        raise ValueError(f"{what}: an object of at most {max_steps} steps")
    for step, spent in value.items():
        if not (isinstance(step, str) and 0 < len(step) <= 64 and step.isascii()):
            raise ValueError(f"{what}: step names are 1 to 64 ASCII characters")
        if type(spent) is not int or not 0 <= spent < 2**63:
            raise ValueError(f"{what}.{step}: a non-negative integer of microseconds")
    return dict(value)


# The steps of a served session's time to first token, in the order they happen (a store of
# JSON objects may not keep the order in which they were written).
SESSION_STEPS = (
    "queued",
    "keys",
    "directive",
    "prompt",
    "first_token",
    "first_checkpoint",
    "first_post",
)


def in_order(timings: dict, steps=SESSION_STEPS) -> list[tuple[str, int]]:
    """``timings`` as (step, microseconds) pairs, known steps first in their order."""
    known = [(step, timings[step]) for step in steps if step in timings]
    return known + sorted((k, v) for k, v in timings.items() if k not in steps)


# The steps of a session's time to first token: waiting for the worker, its Block Keys, loading
# what the directive brings, computing the rest of the prompt, drawing the first token.
FIRST_TOKEN_STEPS = SESSION_STEPS[: SESSION_STEPS.index("first_token") + 1]


def first_token_parts(timings: dict) -> tuple[list[tuple[str, int]], int | None]:
    """The steps of ``timings`` that make up its time to first token, in order, and that time
    in microseconds: None when no first token was drawn."""
    parts = [(step, timings[step]) for step in FIRST_TOKEN_STEPS if step in timings]
    total = sum(spent for _, spent in parts) if "first_token" in timings else None
    return parts, total
