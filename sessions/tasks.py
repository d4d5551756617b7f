"""Tasks of session failover: moving the sessions of an instance that failed or restarted,
sending resume to the chosen instance, and the sweep that sends again every resume still owed
(each is work recorded on a row first)."""

from __future__ import annotations

from common.peers import PeerUnreachable, call, peer_client, raise_for_problem
from common.tasks import add_housekeeping, kvsp_task
from kvsp.problems import ProtocolError
from sessions import services
from sessions.models import Session, SessionState


@kvsp_task(name="sessions.fail_over_instance", time_limit=120)
def fail_over_instance(instance_id: int) -> int:
    """Resume elsewhere the sessions of an instance that failed or restarted (6.8). The PC's
    placement app starts it by name as it fails the instance (``placement.services``); moving a
    session twice is harmless, as a moved one is no longer the instance's. Returns how many
    moved."""
    return len(services.do_fail_over_instance_sessions(instance_id))


@kvsp_task(name="sessions.send_resume", max_retries=0, time_limit=60)
def send_resume(pk: int, epoch: int) -> str:
    """POST sessions/{id}/resume on the chosen instance (6.8); another instance if it refuses
    or never answers."""
    session = Session.objects.select_related("instance").filter(pk=pk).first()
    if (
        session is None
        or session.epoch != epoch
        or session.state != SessionState.RESUMING
        or session.instance is None
    ):
        return "superseded"
    if session.resume_sent_at is not None:
        return "done"
    url = f"{session.instance.url}sessions/{session.session}/resume"
    try:
        with peer_client() as client:
            raise_for_problem(call(client, "POST", url, json=services.resume_body(session)))
    except PeerUnreachable:
        return services.do_resume_unanswered(pk, epoch)
    except ProtocolError as error:
        services.do_resume_refused(pk, epoch, error.detail)
        return f"refused ({error.problem}): resumed elsewhere"
    services.do_resume_accepted(pk, epoch)
    return "sent"


@kvsp_task(name="sessions.retry_stalled", time_limit=120, max_retries=0)
def retry_stalled() -> int:
    """Work owed to sessions whose message was lost or is not due yet: sessions waiting for an
    instance to resume on (others may be up now), sessions still with an instance that failed,
    and resumes sent but neither accepted nor refused. Returns how many it moved or sent."""
    stalled = Session.objects.filter(state=SessionState.RESUMING, instance__isnull=True)
    moved = sum(
        services.do_fail_over_session(pk, failed_instance_id=None)
        for pk in stalled.values_list("pk", flat=True)
    )
    return moved + services.do_fail_over_lost_sessions() + services.do_resend_owed_resumes()


add_housekeeping("retry-stalled-sessions", "sessions.retry_stalled", 5.0)
