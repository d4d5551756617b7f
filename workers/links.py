"""The links a node reports (spec 6.3 "links"), measured from its own block transfers.

The cost model (6.4) prices a fetch with these figures, so they measure the link, not the
node's pipeline around it. The round trip is the quickest response head of the GETs from a
holder. The rate is the octets of their bodies over the time during which at least one of them
was receiving its body (the union of the transfer intervals, on one clock): GETs side by side
count once, as the link carries them together, and the time spent verifying, storing and
publishing between transfers does not count at all. Every loader (prefetch, resume, reshard)
measures through ``LinkMeter``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import NamedTuple


class Transfer(NamedTuple):
    """One GET's body on the ``time.perf_counter()`` clock: from its response head to its last
    octet, and the round trip to that head."""

    head_at: float
    last_octet_at: float
    head_s: float
    octets: int


class LinkFigures(NamedTuple):
    rtt_us: float
    mbit_per_s: float


def link_figures(transfers: list[Transfer]) -> LinkFigures | None:
    """The figures of a link from the transfers over it; None when nothing was received."""
    octets = sum(t.octets for t in transfers)
    if not octets:
        return None
    busy_s, end = 0.0, float("-inf")
    for start, stop in sorted((t.head_at, t.last_octet_at) for t in transfers):
        if stop <= end:
            continue
        busy_s += stop - max(start, end)
        end = stop
    return LinkFigures(
        rtt_us=min(t.head_s for t in transfers) * 1e6,
        mbit_per_s=8 * octets / max(busy_s * 1e6, 1.0),
    )


class LinkMeter:
    """The transfers of one load, per holder, from any number of threads."""

    def __init__(self):
        self._transfers: dict[str, list[Transfer]] = defaultdict(list)
        self._lock = threading.Lock()

    def add(self, holder: str, transfer: Transfer) -> None:
        with self._lock:
            self._transfers[holder].append(transfer)

    def figures(self) -> dict[str, LinkFigures]:
        with self._lock:
            measured = {holder: link_figures(t) for holder, t in self._transfers.items()}
        return {holder: figures for holder, figures in measured.items() if figures is not None}

    def record(self, instance: str) -> None:
        """Fold the figures into the instance's measured links (its status reports list them)."""
        from workers.instance import do_record_link

        for holder, figures in self.figures().items():
            do_record_link(instance, holder, rtt_us=figures.rtt_us, mbit_per_s=figures.mbit_per_s)
