"""Tasks of a node's worker, sent to its queue ``ii.<name>``. Thin: each re-reads its row and
calls one function, and running one again does no harm."""

from __future__ import annotations

from common.tasks import kvsp_task
from kvsp.problems import ProtocolError
from workers import directives, generation, resharding, runtime


@kvsp_task(name="workers.prefetch", bind=True, max_retries=3, time_limit=900)
def prefetch(self, directive_pk: int) -> str:
    """Carry out a prefetch directive (spec 6.5); a finished one is left as it is. A block that
    failed only for now (a source out of reach or answering 5xx) runs it again later, until the
    last try fails it."""
    node = runtime.current()
    return directives.run_directive(
        directive_pk,
        node.device_tier if node else None,
        retry_later=self.request.retries < self.max_retries,
    )


@kvsp_task(name="workers.load_reshard", max_retries=3, time_limit=900)
def load_reshard(move_pk: int) -> str:
    """Load the fetch ranges of a reshard plan (spec 6.9); a move loaded or decided already is
    left as it is."""
    return resharding.load(move_pk)


@kvsp_task(name="workers.measure_engine", ignore_result=False, max_retries=0, time_limit=120)
def measure_engine(decode_steps: int = 32) -> dict:
    """Measure the engine's prefill and decode rates (reported from then on), with the time of
    each decoding step."""
    node = runtime.current()
    if node is None:
        raise ProtocolError("kvsp-unavailable", "this worker does not serve a node's queue")
    return node.measure_engine(decode_steps)


@kvsp_task(name="workers.engine_state", ignore_result=False, max_retries=0, time_limit=30)
def engine_state() -> dict:
    """Whether the engine is loaded, its warm-up before the node said it serves, and the
    forward passes it has run; loads nothing."""
    node = runtime.current()
    if node is None:
        raise ProtocolError("kvsp-unavailable", "this worker does not serve a node's queue")
    return node.engine_state()


@kvsp_task(name="workers.serve_session", max_retries=0, autoretry_for=(), time_limit=24 * 3600)
def serve_session(session_pk: int) -> str:
    """Serve a session the instance admitted (spec 6.8): a generation or a resume. Never run
    twice: a session cut short here is the PC's to resume elsewhere."""
    return generation.serve(session_pk, runtime.current())


@kvsp_task(name="workers.prompt_logits", ignore_result=False, max_retries=0, time_limit=120)
def prompt_logits(scope_id: str, compat_id: str, tokens: list, recompute: bool = False) -> dict:
    """The next-token logits of a prompt as this instance would serve it (held blocks imported
    from the tier store, the rest computed; all of it computed with ``recompute``): an
    operator's check that cached blocks serve a prompt as computing it does."""
    return generation.prompt_logits(
        runtime.current(),
        bytes.fromhex(scope_id),
        bytes.fromhex(compat_id),
        tokens,
        recompute=recompute,
    )
