"""Session checkpoints, the front end's output stream, and failover (spec 6.8).

The PC issues session epochs (``kvsp.states`` EpochRole.ISSUER): a message from a lower epoch
is stale everywhere, and one claiming an epoch the PC never issued is refused. Within an epoch
the stored checkpoint only moves forward (highest ``output_offset``), and each output index is
delivered once and never changed. A session's state changes only as ``SESSION_STATES`` allows.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from common.permissions import has_scope_grant, may_read_scope
from common.tasks import enqueue
from index.authentication import CONTROLLER
from index.models import CompatDescriptor, Scope
from index.scopekeys import open_scope_key
from kvsp import blockkeys
from kvsp.hexids import parse_uuid
from kvsp.problems import ProtocolError
from kvsp.records import (
    CheckpointAnswer,
    InvalidRecord,
    OutputAnswer,
    SessionCheckpoint,
    parse_output_post,
)
from kvsp.states import (
    SESSION_STATES,
    EpochRole,
    SessionEvent,
    accept_epoch,
    next_session_epoch,
)
from kvsp.timeline import check_timings
from placement import delivery, pricing
from placement.models import Instance, InstanceState
from sessions import metrics, selectors, streams
from sessions.models import OutputToken, Session, SessionState

log = logging.getLogger(__name__)

# Unanswered sends of one resume before the session is resumed elsewhere.
MAX_RESUME_ATTEMPTS = 6


def parse_session_id(value: str) -> uuid.UUID:
    return parse_uuid(value, "session", problem="kvsp-malformed-request")


def _principal_instance(principal) -> Instance:
    instance = (
        Instance.objects.filter(name=principal.instance).first() if principal.instance else None
    )
    if instance is None:
        raise ProtocolError("kvsp-forbidden", "only the principal of a registered instance may")
    return instance


@dataclass(frozen=True)
class CheckpointTaken:
    session: Session
    created: bool
    # The answer to the tokens that came with the checkpoint (extension member ``output``).
    output: OutputAnswer | None = None

    def answer(self) -> CheckpointAnswer:
        return CheckpointAnswer(
            session=str(self.session.session),
            epoch=self.session.epoch,
            output_offset=self.session.checkpoint_offset,
            output=self.output,
        )


def do_checkpoint(principal, session_id: str, body: object, *, now=None) -> CheckpointTaken:
    """PUT sessions/{session}/checkpoint (6.8): keep the highest output_offset of the current
    epoch; refuse lower epochs with kvsp-stale-epoch. The answer acknowledges the offset the PC
    holds, which is what lets an instance release tokens of a non-deterministic sampler.

    The extension member ``output`` carries output tokens the checkpoint covers, as ``POST
    sessions/{session}/output`` would: they are taken after the checkpoint, in the same
    transaction (nothing of either is kept when one is refused), and the answer's ``output``
    is what that POST would have answered. An instance saves the round trip of the post.
    """
    output = body.get("output") if isinstance(body, dict) else None
    if output is None:
        return _record_checkpoint(principal, session_id, body, now=now)
    with transaction.atomic():
        answer = _record_checkpoint(principal, session_id, body, now=now)
        taken = do_post_output(principal, session_id, output, now=now)
    return replace(answer, output=taken)


def _record_checkpoint(principal, session_id: str, body: object, *, now=None) -> CheckpointTaken:
    checkpoint = SessionCheckpoint.from_json(body)
    timings = _timings(body)
    key = parse_session_id(session_id)
    if checkpoint.session != str(key):
        raise ProtocolError("kvsp-malformed-request", "session in the body differs from the path")
    if not has_scope_grant(principal, bytes.fromhex(checkpoint.scope_id)):
        raise ProtocolError("kvsp-forbidden", "not authorized for the checkpoint's scope")
    instance = _principal_instance(principal)
    now = now or timezone.now()
    created = False
    if not Session.objects.filter(session=key).exists():
        accept_epoch(EpochRole.ISSUER, next_session_epoch(None), checkpoint.epoch, "epoch")
        try:
            with transaction.atomic():
                Session.objects.create(
                    session=key,
                    scope_id=bytes.fromhex(checkpoint.scope_id),
                    compat_id=bytes.fromhex(checkpoint.compat_id),
                    instance=instance,
                    epoch=checkpoint.epoch,
                    checkpoint=checkpoint.to_json(),
                    checkpoint_epoch=checkpoint.epoch,
                    checkpoint_offset=checkpoint.output_offset,
                    checkpoints=1,
                    timings_us=timings,
                )
                created = True
                if timings is not None:
                    transaction.on_commit(lambda: metrics.observe_timeline(timings))
        except IntegrityError:
            pass  # a concurrent first checkpoint won: treat this one as a later one
    with transaction.atomic():
        session = Session.objects.select_for_update().get(session=key)
        if created:
            return CheckpointTaken(session, True)
        accept_epoch(EpochRole.ISSUER, session.epoch, checkpoint.epoch, "epoch")
        if session.instance_id != instance.pk:
            raise ProtocolError("kvsp-forbidden", "the session is served by another instance")
        if (bytes(session.scope_id), bytes(session.compat_id)) != (
            bytes.fromhex(checkpoint.scope_id),
            bytes.fromhex(checkpoint.compat_id),
        ):
            raise ProtocolError(
                "kvsp-invalid-record", "scope_id and compat_id of a session never change"
            )
        newer_epoch = session.checkpoint_epoch < checkpoint.epoch
        if newer_epoch or checkpoint.output_offset > session.checkpoint_offset:
            session.checkpoint = checkpoint.to_json()
            session.checkpoint_epoch = checkpoint.epoch
            session.checkpoint_offset = max(session.checkpoint_offset, checkpoint.output_offset)
        session.checkpoints += 1
        if timings is not None:
            session.timings_us = timings
            transaction.on_commit(lambda: metrics.observe_timeline(timings))
        if session.state == SessionState.RESUMING:
            session.state = SESSION_STATES.next_state(session.state, SessionEvent.RESUMED)
        session.save()
    return CheckpointTaken(session, False)


def _timings(body: dict) -> dict | None:
    """The extension member ``timings_us`` of a checkpoint: the instance's account of its time
    to first token (``kvsp.timeline``), kept on the session for the dashboard."""
    value = body.get("timings_us")
    if value is None:
        return None
    try:
        return check_timings(value)
    except ValueError as error:
        raise ProtocolError("kvsp-invalid-record", str(error)) from None


def do_post_output(principal, session_id: str, body: object, *, now=None) -> OutputAnswer:
    """POST sessions/{session}/output: the front end keeps each index once and refuses tokens
    of a lower epoch than the session's (6.8). With a non-deterministic sampler, a token not
    yet covered by an acknowledged checkpoint is refused too: the instance must not release it.
    """
    key = parse_session_id(session_id)
    try:
        tokens = parse_output_post(body)
    except InvalidRecord as error:
        # Output tokens are not a record of the spec: a post the core refuses is a malformed
        # request (400), its detail naming the member and the rule broken.
        raise ProtocolError("kvsp-malformed-request", error.detail) from None
    now = now or timezone.now()
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(session=key).first()
        if session is None or not has_scope_grant(principal, session.scope_id):
            raise ProtocolError("kvsp-not-found", "no such session")
        for token in tokens:
            accept_epoch(EpochRole.ISSUER, session.epoch, token.epoch, "epoch")
        if principal.instance != (session.instance.name if session.instance else None):
            raise ProtocolError("kvsp-forbidden", "the session is served by another instance")
        sampler = (session.checkpoint or {}).get("sampler", {})
        if not sampler.get("deterministic", False):
            uncovered = [t.index for t in tokens if t.index >= session.checkpoint_offset]
            if uncovered:
                raise ProtocolError(
                    "kvsp-conflict",
                    f"index {uncovered[0]} is not covered by an acknowledged checkpoint "
                    f"(output_offset {session.checkpoint_offset})",
                )
        indices = [t.index for t in tokens]
        existing = set(
            OutputToken.objects.filter(session=session, index__in=indices).values_list(
                "index", flat=True
            )
        )
        fresh = {t.index: t for t in tokens if t.index not in existing}
        OutputToken.objects.bulk_create(
            [
                OutputToken(session=session, index=t.index, token=t.token, epoch=t.epoch)
                for t in fresh.values()
            ],
            ignore_conflicts=True,
        )
        session.delivered = OutputToken.objects.filter(session=session).count()
        finals = [t.index + 1 for t in tokens if t.final]
        if finals:
            session.final_length = max(finals)
        if fresh and session.failovers and session.resumed_first_token_at is None:
            session.resumed_first_token_at = now
        if session.final_length is not None and session.delivered >= session.final_length:
            session.state = SESSION_STATES.next_state(session.state, SessionEvent.DELIVERED)
            session.completed_at = session.completed_at or now
        session.save()
        if fresh or session.state == SessionState.COMPLETED:
            transaction.on_commit(lambda: streams.output_changed(key))
    metrics.OUTPUT_TOKENS.labels("stored").inc(len(fresh))
    metrics.OUTPUT_TOKENS.labels("duplicate").inc(len(tokens) - len(fresh))
    return OutputAnswer(
        session=str(key),
        epoch=session.epoch,
        stored=tuple(sorted(fresh)),
        duplicates=tuple(sorted(set(indices) - set(fresh))),
        delivered=session.delivered,
    )


def output_of(principal, session_id: str, *, after: int = -1) -> dict:
    """The delivered tokens after index ``after``, for a principal of the session's scope."""
    key = parse_session_id(session_id)
    session = Session.objects.filter(session=key).first()
    if session is None or not may_read_scope(principal, session.scope_id):
        raise ProtocolError("kvsp-not-found", "no such session")
    return selectors.output_after(session, after)


def session_json(session: Session) -> dict:
    """A session as the API and the dashboard show it."""
    return {
        "session": str(session.session),
        "epoch": session.epoch,
        "state": session.state,
        "instance": session.instance.url if session.instance else None,
        "instance_name": session.instance.name if session.instance else None,
        "checkpoint": session.checkpoint,
        "output_offset": session.checkpoint_offset,
        "delivered": session.delivered,
        "final_length": session.final_length,
        "failovers": session.failovers,
    }


# --- Failover ---------------------------------------------------------------------------------


def session_block_keys(session: Session) -> list[bytes]:
    """The Block Keys of everything the checkpoint covers: prompt blocks, then the complete
    blocks of prompt tail + covered generated tokens, continuing the same chain (4.2).
    """
    checkpoint = SessionCheckpoint.from_json(session.checkpoint)
    keys = [bytes.fromhex(key) for key in checkpoint.prompt_blocks]
    scope = Scope.objects.get(scope_id=session.scope_id)
    descriptor = CompatDescriptor.objects.filter(compat_id=session.compat_id).first()
    if descriptor is None:
        return keys
    chain = blockkeys.BlockKeyChain.after(
        open_scope_key(scope.scope_id, scope.key_ciphertext),
        bytes(session.compat_id),
        descriptor.block_tokens,
        keys,
    )
    keys += chain.extend(list(checkpoint.prompt_tail) + list(checkpoint.covered_generated))
    return keys


def resume_plan(session: Session, *, exclude=(), now=None):
    """The cheapest active instance to resume a session on (6.4), but those of ``exclude``
    (ids), priced as placement prices (``placement.pricing.price_prefix``), with the blocks it
    holds and where to load the others from: (instance, resident keys,
    ``kvsp.cost.BlockSources`` of the others), or (None, (), ()) when none serves it."""
    now = now or timezone.now()
    keys = session_block_keys(session)
    descriptor = CompatDescriptor.objects.filter(compat_id=session.compat_id).first()
    block_tokens = descriptor.block_tokens if descriptor else 1
    checkpoint = SessionCheckpoint.from_json(session.checkpoint)
    tokens = len(checkpoint.prompt_blocks) * block_tokens + len(checkpoint.prompt_tail)
    tokens += len(checkpoint.covered_generated)
    # A failed instance is no source: the PC has judged it gone, and one that is only paused
    # would hold every load up until the resume's deadline.
    gone = set(Instance.objects.filter(state=InstanceState.FAILED).values_list("url", flat=True))
    prefix = pricing.price_prefix(
        CONTROLLER,
        bytes(session.compat_id),
        bytes(session.scope_id),
        keys,
        block_tokens=block_tokens,
        prompt_tokens=tokens,
        now=now,
        exclude_holders=gone,
        exclude_instances=exclude,
    )
    chosen = pricing.cheapest(prefix.priced)
    if chosen is None:
        return None, (), ()
    resident, fetched = prefix.block_sources(chosen)
    return Instance.objects.get(pk=chosen.instance.pk), resident, fetched


def do_fail_over_instance_sessions(instance_id: int, *, now=None) -> list[uuid.UUID]:
    """The instance failed or restarted: raise the epoch of each of its sessions and resume
    them elsewhere (6.8). Sessions without a checkpoint cannot be resumed and fail.
    """
    now = now or timezone.now()
    moved = []
    for pk in Session.objects.filter(
        instance_id=instance_id, state__in=SESSION_STATES.sources(SessionEvent.FAIL_OVER)
    ).values_list("pk", flat=True):
        if do_fail_over_session(pk, failed_instance_id=instance_id, now=now):
            moved.append(pk)
    return moved


def do_fail_over_session(pk: int, *, failed_instance_id: int | None, now=None) -> bool:
    now = now or timezone.now()
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(pk=pk).first()
        if session is None or not SESSION_STATES.allows(session.state, SessionEvent.FAIL_OVER):
            return False
        if failed_instance_id is not None and session.instance_id != failed_instance_id:
            return False  # already moved by an earlier failover
        if session.checkpoint is None:
            session.state = SESSION_STATES.next_state(session.state, SessionEvent.NOTHING_TO_RESUME)
            session.resume_error = "the instance failed before the first checkpoint"
            session.save()
            return False
        instance, resident, fetched = resume_plan(
            session, exclude={failed_instance_id} if failed_instance_id else set(), now=now
        )
        # A session already waiting for an instance keeps the epoch it was given: nobody has
        # served under it yet.
        waiting = session.state == SessionState.RESUMING and session.instance_id is None
        if not waiting:
            session.epoch = next_session_epoch(session.epoch)
            session.failovers += 1
            session.failed_over_at = now
            session.resumed_first_token_at = None
        session.state = SESSION_STATES.next_state(session.state, SessionEvent.FAIL_OVER)
        session.instance = instance
        session.resume_sent_at = None
        session.resume_error = "" if instance else "no active instance serves the session"
        # The resume is owed work on this row before it is a message: when the message is lost
        # (the broker down as this commits, say), the sweep finds the row and sends it again.
        session.resume_attempts = 0
        if instance is None:
            session.resume_blocks, session.resume_resident, session.resume_due_at = [], [], None
        else:
            session.resume_blocks = [block.directive_block().to_json() for block in fetched]
            session.resume_resident = list(resident)
            session.resume_due_at = now + _resend_after()
        session.save()
        log.info("session %s: epoch %s, resuming on %s", session.session, session.epoch, instance)
        if instance is not None:
            epoch = session.epoch
            transaction.on_commit(lambda: _send_resume_now(pk, epoch))
    return True


def _resend_after() -> timedelta:
    return timedelta(seconds=settings.KVSP_RESUME_RESEND_S)


def resume_body(session: Session) -> dict:
    """POST {ii-base}sessions/{session}/resume: the latest checkpoint and the new epoch (6.8),
    with where to load its blocks from (prefix order; ``resident`` ones the instance holds).
    """
    return {
        "session": str(session.session),
        "epoch": session.epoch,
        "checkpoint": session.checkpoint,
        "blocks": session.resume_blocks,
        "resident": session.resume_resident,
        "deadline_ms": settings.KVSP_PREFETCH_DEADLINE_MS,
        "lease_ms": settings.KVSP_PREFETCH_LEASE_MS,
    }


def _send_resume_now(pk: int, epoch: int) -> None:
    """Send a committed resume from this process's senders, without a hop through the control
    queue; the task ``send_resume`` is the path that retries."""
    from sessions.tasks import send_resume

    delivery.run_soon(
        lambda: send_resume(pk, epoch),
        lambda: _send_resume_later(pk, epoch),
        f"resume of session row {pk} under epoch {epoch}",
    )


def _send_resume_later(pk: int, epoch: int, *, countdown: float | None = None) -> None:
    from sessions.tasks import send_resume

    enqueue(send_resume, pk, epoch, countdown=countdown)


def _owed(now):
    """Sessions whose resume their instance has neither accepted nor refused yet."""
    return Session.objects.filter(
        state=SessionState.RESUMING, instance__isnull=False, resume_sent_at__isnull=True
    ).filter(Q(resume_due_at__isnull=True) | Q(resume_due_at__lte=now))


def do_resend_owed_resumes(*, now=None) -> int:
    """The sweep's part: send again every resume that is due and unanswered, and count it as
    sent for ``KVSP_RESUME_RESEND_S`` (so that the next sweep leaves it to this message)."""
    now = now or timezone.now()
    with transaction.atomic():
        due = list(_owed(now).select_for_update(skip_locked=True).values_list("pk", "epoch"))
        Session.objects.filter(pk__in=[pk for pk, _ in due]).update(
            resume_due_at=now + _resend_after()
        )
    for pk, epoch in due:
        _send_resume_later(pk, epoch)
    return len(due)


def do_resume_accepted(pk: int, epoch: int, *, now=None) -> None:
    Session.objects.filter(pk=pk, epoch=epoch, resume_sent_at__isnull=True).update(
        resume_sent_at=now or timezone.now(), resume_due_at=None
    )


def do_resume_unanswered(pk: int, epoch: int, *, now=None) -> str:
    """The instance could not be reached (or failed to answer): try again after a backoff, and
    after ``MAX_RESUME_ATTEMPTS`` resume the session elsewhere."""
    now = now or timezone.now()
    with transaction.atomic():
        session = (
            Session.objects.select_for_update()
            .filter(pk=pk, epoch=epoch, state=SessionState.RESUMING, resume_sent_at__isnull=True)
            .first()
        )
        if session is None:
            return "superseded"
        session.resume_attempts += 1
        if session.resume_attempts >= MAX_RESUME_ATTEMPTS:
            failed_instance_id = session.instance_id
        else:
            failed_instance_id = None
            backoff = min(2 ** (session.resume_attempts - 1), 30)
            # The sweep steps in only when the retry below does not come.
            session.resume_due_at = now + timedelta(seconds=backoff) + _resend_after()
        session.save(update_fields=["resume_attempts", "resume_due_at"])
    if failed_instance_id is not None:
        do_fail_over_session(pk, failed_instance_id=failed_instance_id)
        return "unreachable: resumed elsewhere"
    _send_resume_later(pk, epoch, countdown=backoff)
    return "unreachable: retried"


def do_resume_refused(pk: int, epoch: int, reason: str) -> None:
    """The instance refused the resume: the session moves on to another."""
    with transaction.atomic():
        session = (
            Session.objects.select_for_update()
            .filter(pk=pk, epoch=epoch, state=SessionState.RESUMING)
            .first()
        )
        if session is None:
            return
        session.resume_error = reason
        session.save(update_fields=["resume_error"])
    do_fail_over_session(pk, failed_instance_id=session.instance_id)


def do_fail_over_lost_sessions(*, now=None) -> int:
    """Sessions still with an instance the PC has failed: their failover was lost (the process
    failing the instance died before it moved them). Move them now."""
    lost = Session.objects.filter(
        state__in=SESSION_STATES.sources(SessionEvent.FAIL_OVER),
        instance__state=InstanceState.FAILED,
    ).values_list("pk", "instance_id")
    return sum(
        do_fail_over_session(pk, failed_instance_id=instance_id, now=now)
        for pk, instance_id in lost
    )
