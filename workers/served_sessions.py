"""Sessions this instance serves (spec 6.8): the requests that start serving one, their rows, and
their changes of state (``kvsp.states.SERVED_SESSION_STATES``).

Two requests start serving a session here:

- ``POST II generate`` is this implementation's own, not the spec's (inference requests are
  outside its scope, 1.3): a new session, under session epoch 1, from a prompt of token ids.
- ``POST II sessions/{session}/resume`` is the PC's (6.8): the instance that served the session
  failed, and this one continues it from the latest checkpoint under a new epoch.

Both are refused while the instance is not active (6.3: a draining instance MUST NOT accept new
sessions), on a holder without an engine, and for a Compatibility ID other than the engine's
(4.1). What the engine serves is read from the node's row, where the worker wrote it when it
loaded the model, so the HTTP process never loads one. An accepted request is a row first and a
task on the instance's queue after (``workers.generation`` serves it); the same request sent
again is the same row.

The session's length travels in the checkpoint's ``sampler.params`` as ``max_tokens``
(``kvsp.records.MAX_TOKENS_PARAM`` says why).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from common.api import require_object
from common.permissions import may_read_scope
from common.tasks import instance_queue
from kvsp.hexids import parse_uuid
from kvsp.problems import ProtocolError
from kvsp.records import (
    MAX_TOKENS_PARAM,
    GenerateRequest,
    PrefetchDirective,
    ResumeRequest,
    Sampler,
)
from kvsp.states import SERVED_SESSION_STATES, ServedSessionEvent
from workers import instance, selectors
from workers.models import (
    Directive,
    Node,
    NodeState,
    ServedSession,
    SessionKind,
)

# Names the prefetch directive a resume loads its blocks with: uuid5 of "session/epoch".
RESUME_DIRECTIVE_NAMESPACE = uuid.UUID("5b0c7d1e-9a43-4f8e-8c21-6d4a2f0e7b93")


def _malformed(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-malformed-request", detail)


def _invalid(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-invalid-record", detail)


def split_max_tokens(sampler: Sampler) -> tuple[dict, int | None]:
    """The sampler's own params, and the session length carried beside them."""
    params = sampler.params.to_json()
    return params, params.pop(MAX_TOKENS_PARAM, None)


def resume_request(session_id: str, body: object) -> ResumeRequest:
    """The body of ``POST II sessions/{session}/resume`` (6.8) for the session of the path,
    with this node's prefetch deadline and lease where the PC left them out."""
    body = require_object(body)
    session = str(parse_uuid(session_id, "session", problem="kvsp-malformed-request"))
    if str(body.get("session", "")).lower() != session:
        raise _malformed("session in the body differs from the path")
    return ResumeRequest.from_json(body).with_prefetch_bounds(
        settings.KVSP_PREFETCH_DEADLINE_MS, settings.KVSP_PREFETCH_LEASE_MS
    )


# --- Admission ------------------------------------------------------------------------------


def _locked_node(name: str) -> Node:
    instance.ensure_node(name)
    return Node.objects.select_for_update().get(name=name)


def _check_servable(node: Node, compat_id: str, tokens) -> dict:
    """What the engine serves, if it can serve this session now; otherwise the refusal."""
    if not settings.KVSP_MODEL_DIR:
        raise ProtocolError(
            "kvsp-invalid-state", "this node is a storage-only holder: it serves no sessions"
        )
    if node.state != NodeState.ACTIVE:
        raise ProtocolError(
            "kvsp-invalid-state",
            f"the instance is {node.state}: it accepts no new sessions (6.3)",
        )
    engine = node.engine
    if engine is None:
        raise ProtocolError("kvsp-unavailable", "the instance's engine is loading; try again")
    if compat_id != engine["compat_id"]:
        raise ProtocolError(
            "kvsp-compat-mismatch",
            f"this instance's engine serves compat {engine['compat_id']}, not {compat_id}",
        )
    vocab = engine["vocab_size"]
    outside = next((token for token in tokens if token >= vocab), None)
    if outside is not None:
        raise _invalid(f"token {outside} is outside the model's vocabulary of {vocab}")
    return engine


def _check_positions(engine: dict, positions: int) -> None:
    if positions > engine["max_positions"]:
        raise _invalid(
            f"the session needs {positions} positions; the model has {engine['max_positions']}"
        )


def _same_request(existing: ServedSession, kind: str, body: dict) -> ServedSession:
    if existing.kind != kind or existing.body != body:
        raise ProtocolError(
            "kvsp-conflict",
            f"session {existing.session} exists here under epoch {existing.epoch} with "
            "another request",
        )
    return existing


def _enqueue(row: ServedSession) -> None:
    from workers.tasks import serve_session

    serve_session.apply_async_on_commit(args=[row.pk], queue=instance_queue(row.instance))


def do_accept_generation(principal, body: object) -> ServedSession:
    """``POST II generate``: admit a new session (epoch 1) from a controller or a principal
    of the prompt's scope."""
    request = GenerateRequest.from_json(body)
    if not may_read_scope(principal, bytes.fromhex(request.scope_id)):
        raise ProtocolError("kvsp-forbidden", "not a principal of the prompt's scope")
    name = selectors.node_name()
    body = request.to_json()
    with transaction.atomic():
        node = _locked_node(name)
        existing = ServedSession.objects.filter(instance=name, session=request.session).first()
        if existing is not None:
            return _same_request(existing, SessionKind.GENERATE, body)
        engine = _check_servable(node, request.compat_id, request.prompt)
        _check_positions(engine, len(request.prompt) + request.max_tokens)
        row = ServedSession.objects.create(
            instance=name,
            session=request.session,
            epoch=1,
            kind=SessionKind.GENERATE,
            scope_id=bytes.fromhex(request.scope_id),
            compat_id=bytes.fromhex(request.compat_id),
            request_ref=request.request_ref or "",
            body=body,
            received_at=timezone.now(),
        )
        _enqueue(row)
    return row


def _sourceless_prompt_block(request: ResumeRequest, name: str) -> str | None:
    """The first prompt block of the checkpoint that this instance neither holds nor is told
    where to load from: the checkpoint names prompt blocks by key alone, so without them the
    session cannot be resumed here."""
    checkpoint = request.checkpoint
    listed = {block.block_key for block in request.blocks} | set(request.resident)
    unlisted = [key for key in checkpoint.prompt_blocks if key not in listed]
    if not unlisted:
        return None
    held = selectors.held_keys(
        name,
        bytes.fromhex(checkpoint.compat_id),
        bytes.fromhex(checkpoint.scope_id),
        [bytes.fromhex(key) for key in unlisted],
    )
    return next((key for key in unlisted if bytes.fromhex(key) not in held), None)


def do_accept_resume(session_id: str, body: object) -> ServedSession:
    """``POST II sessions/{session}/resume`` (6.8), the PC's: admit the session under its new
    epoch; the blocks to load become a prefetch directive the session's task carries out."""
    request = resume_request(session_id, body)
    checkpoint = request.checkpoint
    name = selectors.node_name()
    body = request.to_json()
    with transaction.atomic():
        node = _locked_node(name)
        rows = ServedSession.objects.filter(instance=name, session=request.session)
        existing = rows.filter(epoch=request.epoch).first()
        if existing is not None:
            return _same_request(existing, SessionKind.RESUME, body)
        later = rows.filter(epoch__gt=request.epoch).order_by("-epoch").first()
        if later is not None:
            raise ProtocolError(
                "kvsp-stale-epoch",
                f"epoch {request.epoch} is lower than epoch {later.epoch}, under which this "
                "instance serves the session already",
            )
        engine = _check_servable(
            node, checkpoint.compat_id, list(checkpoint.prompt_tail) + list(checkpoint.generated)
        )
        max_tokens = split_max_tokens(checkpoint.sampler)[1] or 0
        _check_positions(
            engine,
            len(checkpoint.prompt_blocks) * engine["block_tokens"]
            + len(checkpoint.prompt_tail)
            + max(max_tokens, checkpoint.output_offset),
        )
        missing = _sourceless_prompt_block(request, name)
        if missing is not None:
            raise ProtocolError(
                "kvsp-conflict",
                f"prompt block {missing} is neither held here nor listed with a source: this "
                "instance cannot resume the session",
            )
        now = timezone.now()
        directive = None
        if request.blocks:
            directive_id = uuid.uuid5(
                RESUME_DIRECTIVE_NAMESPACE, f"{request.session}/{request.epoch}"
            )
            record = PrefetchDirective(
                directive=str(directive_id),
                request_ref=f"resume {request.session} epoch {request.epoch}",
                scope_id=checkpoint.scope_id,
                compat_id=checkpoint.compat_id,
                blocks=request.blocks,
                deadline_ms=request.deadline_ms,
                lease_ms=request.lease_ms,
            )
            directive = Directive.objects.create(
                instance=name,
                directive=directive_id,
                request_ref=record.request_ref,
                compat_id=bytes.fromhex(checkpoint.compat_id),
                scope_id=bytes.fromhex(checkpoint.scope_id),
                body=record.to_json(),
                received_at=now,
                deadline_at=now + timedelta(milliseconds=request.deadline_ms),
            )
        row = ServedSession.objects.create(
            instance=name,
            session=request.session,
            epoch=request.epoch,
            kind=SessionKind.RESUME,
            scope_id=bytes.fromhex(checkpoint.scope_id),
            compat_id=bytes.fromhex(checkpoint.compat_id),
            body=body,
            directive=directive,
            output_offset=checkpoint.output_offset,
            produced=checkpoint.output_offset,
            checkpoint_offset=checkpoint.output_offset,
            received_at=now,
        )
        _enqueue(row)
    return row


# --- State changes ----------------------------------------------------------------------------


def do_start(pk: int, node_epoch: int) -> bool:
    """The worker takes an accepted row up; False when it was taken up (or ended) already, as
    for a task delivered again."""
    with transaction.atomic():
        row = ServedSession.objects.select_for_update().filter(pk=pk).first()
        if row is None or not SERVED_SESSION_STATES.allows(row.state, ServedSessionEvent.START):
            return False
        row.state = SERVED_SESSION_STATES.next_state(row.state, ServedSessionEvent.START)
        row.node_epoch = node_epoch
        row.started_at = timezone.now()
        row.save(update_fields=["state", "node_epoch", "started_at"])
    return True


def do_finish(pk: int, event: ServedSessionEvent, reason: str = "", **progress) -> str:
    """End a session here (completed, superseded or failed) with its last progress figures."""
    with transaction.atomic():
        row = ServedSession.objects.select_for_update().get(pk=pk)
        row.state = SERVED_SESSION_STATES.next_state(row.state, event)
        row.reason = reason
        row.finished_at = timezone.now()
        for field, value in progress.items():
            setattr(row, field, value)
        row.save()
    return row.state


def do_note_progress(pk: int, **progress) -> None:
    """The worker's figures of a running session, written at each checkpoint."""
    ServedSession.objects.filter(pk=pk).update(**progress)
