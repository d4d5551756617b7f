"""Reads of sessions (spec 6.8): the output the front end serves, and what the dashboard and
/metrics show the operator."""

from __future__ import annotations

import uuid

from django.db.models import Case, Count, IntegerField, Sum, Value, When
from django.utils import timezone

from sessions.models import OpenStream, OutputToken, Session, SessionState

# Sessions still under way come first in the operator's lists.
_UNDER_WAY = (SessionState.RUNNING, SessionState.RESUMING)


def output_after(session: Session, after: int) -> dict:
    """The delivered tokens of ``session`` after index ``after``, as ``GET output`` answers."""
    tokens = OutputToken.objects.filter(session=session, index__gt=after).values_list(
        "index", "token", "epoch"
    )
    return {
        "session": str(session.session),
        "epoch": session.epoch,
        "state": session.state,
        "tokens": [{"index": i, "token": t, "epoch": e} for i, t, e in tokens],
        "complete": session.state == SessionState.COMPLETED,
    }


def session_by_id(key: uuid.UUID) -> Session | None:
    return Session.objects.select_related("instance").filter(session=key).first()


def recent_sessions(limit: int = 50, *, instance=None) -> list[Session]:
    """Sessions under way (running, resuming) first, then the most recently updated."""
    sessions = Session.objects.select_related("instance")
    if instance is not None:
        sessions = sessions.filter(instance=instance)
    under_way_first = Case(
        When(state__in=_UNDER_WAY, then=Value(0)), default=Value(1), output_field=IntegerField()
    )
    return list(sessions.order_by(under_way_first, "-updated_at")[:limit])


def session_state_counts() -> dict[str, int]:
    counts = dict.fromkeys(SessionState.values, 0)
    for row in Session.objects.values("state").annotate(n=Count("pk")):
        counts[row["state"]] = row["n"]
    return counts


def failover_total() -> int:
    """Failovers of every session recorded: each raised a session's epoch (6.8)."""
    return Session.objects.aggregate(total=Sum("failovers"))["total"] or 0


def tokens(session: Session, *, after: int = -1, limit: int | None = None) -> list[OutputToken]:
    """Delivered output tokens after index ``after`` in index order; with ``limit``, the last
    ``limit`` of them."""
    delivered = OutputToken.objects.filter(session=session, index__gt=after)
    if limit is None:
        return list(delivered.order_by("index"))
    return list(reversed(delivered.order_by("-index")[:limit]))


def open_stream_count() -> int:
    """Output streams open now, across the control plane's processes (rows not lapsed)."""
    return OpenStream.objects.filter(expires_at__gt=timezone.now()).count()
