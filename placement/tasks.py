"""Tasks of the Placement Controller: pushing state changes and directives to instances, polling
directives, and the housekeeping that detects failed instances. Thin: each re-reads its row,
returns early when the work is done, and calls one service or one peer request.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery.signals import worker_process_init, worker_ready
from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from common.peers import call, peer_client, raise_for_problem
from common.tasks import add_housekeeping, kvsp_task
from kvsp import fetchplan
from kvsp.problems import ProtocolError
from kvsp.records import DirectiveStatusRecord
from kvsp.states import DIRECTIVE_STATES, DirectiveEvent
from placement import delivery, resharding, services
from placement.models import (
    Directive,
    DirectiveState,
    Instance,
    ReshardOperation,
)

log = logging.getLogger(__name__)


@kvsp_task(name="placement.push_state", max_retries=20, time_limit=60)
def push_state(instance_id: int, version: int) -> str:
    """PUT state on the instance (spec 6.3) until it has the PC's latest decision."""
    instance = Instance.objects.filter(pk=instance_id).first()
    if instance is None or instance.pushed_state_version >= version:
        return "done"
    if instance.state_version > version:
        return "superseded"  # a later change has its own task
    with peer_client() as client:
        raise_for_problem(
            call(client, "PUT", f"{instance.url}state", json={"state": instance.state})
        )
    Instance.objects.filter(pk=instance_id, pushed_state_version__lt=version).update(
        pushed_state_version=version
    )
    return "pushed"


@kvsp_task(name="placement.send_directive", max_retries=5, time_limit=30)
def send_directive(directive_id: int) -> str:
    """POST prefetch on the chosen instance (spec 6.5): the retry of a directive that its
    process could not send at once (``placement.delivery``)."""
    with peer_client() as client:
        return delivery.deliver(directive_id, client=client)


@kvsp_task(name="placement.poll_directive", max_retries=10, time_limit=30)
def poll_directive(directive_id: int) -> str:
    """Read a sent directive's state from the instance until it is final."""
    directive = Directive.objects.select_related("instance").filter(pk=directive_id).first()
    if directive is None or directive.state != DirectiveState.PENDING:
        return "done"
    url = directive.status_url or f"{directive.instance.url}prefetch/{directive.directive}"
    try:
        with peer_client() as client:
            response = raise_for_problem(call(client, "GET", url))
        status = DirectiveStatusRecord.from_json(response.json())
    except ProtocolError as error:
        # The instance does not know the directive (it restarted, say) or answers nonsense.
        delivery.finish_directive(directive.pk, DirectiveEvent.LOAD_FAILED, reason=error.detail)
        return "failed"
    Directive.objects.filter(pk=directive_id).update(polled_at=timezone.now())
    if status.state != DirectiveState.PENDING:
        # The instance's directive took this event: the row here follows it.
        event = DIRECTIVE_STATES.event_between(directive.state, status.state)
        delivery.finish_directive(
            directive.pk, event, loaded=list(status.loaded), reason=status.reason or ""
        )
        return status.state
    waited_ms = (timezone.now() - directive.created_at).total_seconds() * 1000
    # The instance stops at the deadline itself; past it (with slack) stop asking.
    if waited_ms > directive.deadline_ms + 30_000:
        delivery.finish_directive(
            directive.pk, DirectiveEvent.LOAD_FAILED, reason="no final state was reported in time"
        )
        return "failed"
    poll_directive.apply_async((directive_id,), countdown=settings.KVSP_DIRECTIVE_POLL_S)
    return "pending"


@kvsp_task(name="placement.drive_reshard", max_retries=30, time_limit=660, bind=True)
def drive_reshard(self, operation_id: int) -> str:
    """Prepare, decide and tell the members of one reshard; retried until all have heard."""
    if not ReshardOperation.objects.filter(pk=operation_id).exists():
        return "gone"
    untold = resharding.drive(operation_id)
    if untold:
        raise self.retry(countdown=min(2**self.request.retries, 30))
    return ReshardOperation.objects.get(pk=operation_id).phase


@kvsp_task(name="placement.resume_reshards", time_limit=120, max_retries=0)
def resume_reshards() -> int:
    """Operations a crashed or restarted PC left behind: drive each to its end again."""
    unfinished = ReshardOperation.objects.filter(finished_at__isnull=True).values_list(
        "pk", flat=True
    )
    for operation_id in unfinished:
        drive_reshard.delay(operation_id)
    return len(unfinished)


@kvsp_task(name="placement.resend_pending", time_limit=120, max_retries=0)
def resend_pending() -> int:
    """Messages owed to instances whose task was lost (a broker that restarted empty, say):
    every one is a row first, so the rows say what to send again. Sending twice is harmless.
    """
    now = timezone.now()
    quiet = now - timedelta(seconds=10)
    unsent = Directive.objects.filter(
        state=DirectiveState.PENDING, sent_at__isnull=True, created_at__lt=quiet
    ).values_list("pk", flat=True)
    unpolled = (
        Directive.objects.filter(state=DirectiveState.PENDING, sent_at__lt=quiet)
        .filter(Q(polled_at__isnull=True) | Q(polled_at__lt=quiet))
        .values_list("pk", flat=True)
    )
    unpushed = Instance.objects.filter(pushed_state_version__lt=F("state_version")).values_list(
        "pk", "state_version"
    )
    count = 0
    for directive_id in unsent:
        send_directive.delay(directive_id)
        count += 1
    for directive_id in unpolled:
        poll_directive.delay(directive_id)
        count += 1
    for instance_id, version in unpushed:
        push_state.delay(instance_id, version)
        count += 1
    return count


@kvsp_task(name="placement.detect_failures", time_limit=60, max_retries=0)
def detect_failures() -> int:
    return len(services.do_mark_expired())


@kvsp_task(name="placement.prune_samples", time_limit=120, max_retries=0)
def prune_samples() -> int:
    return services.do_prune_samples()


add_housekeeping(
    "detect-failed-instances", "placement.detect_failures", settings.KVSP_FAILURE_CHECK_S
)
add_housekeeping("prune-status-samples", "placement.prune_samples", 300.0)
add_housekeeping("resume-reshards", "placement.resume_reshards", 10.0)
add_housekeeping("resend-pending", "placement.resend_pending", 10.0)


@worker_process_init.connect
def _warm_in_pool_process(**_) -> None:
    if settings.KVSP_ROLE == "control":
        fetchplan.warm_in_background()


@worker_ready.connect
def _warm_in_worker(sender=None, **_) -> None:
    # A prefork worker's parent forks pool processes: they warm themselves (above).
    pool = getattr(sender, "pool", None)
    if settings.KVSP_ROLE == "control" and "prefork" not in type(pool).__module__:
        fetchplan.warm_in_background()
