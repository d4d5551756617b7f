"""Tasks of a node's worker, sent to its queue ``ii.<name>``. Thin: each re-reads its row and
calls one function, and running one again does no harm."""

from __future__ import annotations

from kvsp.problems import ProtocolError
from kvspsite.celery import kvsp_task
from workers import prefetch as prefetching
from workers import runtime


@kvsp_task(name="workers.prefetch", max_retries=3, time_limit=900)
def prefetch(directive_pk: int) -> str:
    """Carry out a prefetch directive (spec 6.5); a finished one is left as it is."""
    node = runtime.current()
    return prefetching.run_directive(directive_pk, node.device_tier if node else None)


@kvsp_task(name="workers.measure_engine", ignore_result=False, max_retries=0, time_limit=120)
def measure_engine(decode_steps: int = 32) -> dict:
    """Measure the engine's prefill and decode rates (reported from then on), with the time of
    each decoding step."""
    node = runtime.current()
    if node is None:
        raise ProtocolError("kvsp-unavailable", "this worker does not serve a node's queue")
    return node.measure_engine(decode_steps)
