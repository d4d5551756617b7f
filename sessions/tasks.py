"""Tasks of session failover: sending resume to the chosen instance, retrying stalled ones."""

from __future__ import annotations

from django.utils import timezone

from kvsp.problems import ProtocolError
from kvspsite.celery import add_housekeeping, kvsp_task
from kvspsite.peers import PeerUnreachable, call, peer_client, raise_for_problem
from sessions import services
from sessions.models import Session, SessionState

MAX_RESUME_RETRIES = 5


@kvsp_task(name="sessions.send_resume", max_retries=MAX_RESUME_RETRIES, time_limit=60, bind=True)
def send_resume(self, pk: int, epoch: int, blocks: list, resident: list) -> str:
    """POST sessions/{id}/resume on the chosen instance (6.8); another instance if it refuses."""
    session = Session.objects.select_related("instance").filter(pk=pk).first()
    if session is None or session.epoch != epoch or session.state != SessionState.RESUMING:
        return "superseded"
    if session.resume_sent_at is not None:
        return "done"
    url = f"{session.instance.url}sessions/{session.session}/resume"
    try:
        with peer_client() as client:
            raise_for_problem(
                call(client, "POST", url, json=services.resume_body(session, blocks, resident))
            )
    except PeerUnreachable:
        if self.request.retries < MAX_RESUME_RETRIES:
            raise
        services.do_fail_over_session(pk, failed_instance_id=session.instance_id)
        return "unreachable: resumed elsewhere"
    except ProtocolError as error:
        Session.objects.filter(pk=pk, epoch=epoch).update(resume_error=error.detail)
        services.do_fail_over_session(pk, failed_instance_id=session.instance_id)
        return f"refused ({error.problem}): resumed elsewhere"
    Session.objects.filter(pk=pk, epoch=epoch, resume_sent_at__isnull=True).update(
        resume_sent_at=timezone.now()
    )
    return "sent"


@kvsp_task(name="sessions.retry_stalled", time_limit=120, max_retries=0)
def retry_stalled() -> int:
    """Sessions waiting for an instance to resume on: try again now that others may be up."""
    stalled = Session.objects.filter(state=SessionState.RESUMING, instance__isnull=True)
    return sum(
        services.do_fail_over_session(pk, failed_instance_id=None)
        for pk in stalled.values_list("pk", flat=True)
    )


add_housekeeping("retry-stalled-sessions", "sessions.retry_stalled", 5.0)
