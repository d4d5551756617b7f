"""What output event streams (``GET sessions/{id}/output`` as server-sent events) share in a
process: wake-ups when their session changes, the threads that read for them, and the rows
that count them against ``KVSP_STREAMS_PER_PRINCIPAL``.

A stream waits on the event loop (``kvspsite/asgibridge.py``), not in a thread, and reads the
database only when woken:

- one watcher per event loop reads, every ``POLL_S`` while any stream is open, the delivered
  count and state of every watched session in one query, and wakes the streams of the sessions
  that changed; tokens POSTed to this process wake its streams at once (``output_changed``);
- the reads run in ``READERS`` threads of their own, never in the threads that answer status
  reports, publications and lookups;
- every open stream is a row (``OpenStream``); the watcher extends its process's rows at every
  heartbeat, and a stream's row is deleted when its response closes, so the cap holds across
  processes and a process that died stops counting once its rows lapse.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from sessions.models import OpenStream, Session

log = logging.getLogger(__name__)

# How often the watcher looks for changes while streams are open: the delay, at most, between
# a token POSTed to another process and its frame.
POLL_S = 0.05
# Threads per process that read for streams (each keeps a database connection).
READERS = 2
# A row lapses after this many heartbeats without being extended.
LEASE_HEARTBEATS = 4
# Serializes the count and the insert of rows per principal on Postgres (SQLite writers take
# the lock at BEGIN already).
_ADVISORY_CLASS = 0x4B565350  # "KVSP"

_readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kvsp-streams")
_watchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_watchers_lock = threading.Lock()
_server: tuple[int, str] | None = None


def server_key() -> str:
    """This process's name on its rows (a forked worker gets a new one)."""
    global _server
    if _server is None or _server[0] != os.getpid():
        _server = (os.getpid(), f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    return _server[1]


def _lease() -> timedelta:
    return timedelta(seconds=LEASE_HEARTBEATS * settings.KVSP_STREAM_HEARTBEAT_S)


# --- The rows ----------------------------------------------------------------------------------


def do_open_stream(principal, session: uuid.UUID, *, now=None) -> int | None:
    """Count a new stream of ``principal``: its row's id, or None when the principal has
    ``KVSP_STREAMS_PER_PRINCIPAL`` streams open already."""
    now = now or timezone.now()
    limit = settings.KVSP_STREAMS_PER_PRINCIPAL
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)", [_ADVISORY_CLASS, principal.id]
                )
        mine = OpenStream.objects.filter(principal=principal.id)
        mine.filter(expires_at__lte=now).delete()
        if limit and mine.count() >= limit:
            return None
        row = OpenStream.objects.create(
            principal=principal.id, session=session, server=server_key(), expires_at=now + _lease()
        )
    return row.pk


def do_close_stream(row: int) -> None:
    try:
        OpenStream.objects.filter(pk=row).delete()
    except DatabaseError as exc:  # the row lapses on its own
        log.warning("an output stream's row was not deleted: %s", exc)


def _extend_streams(rows: list[int]) -> None:
    now = timezone.now()
    OpenStream.objects.filter(pk__in=rows).update(expires_at=now + _lease())
    OpenStream.objects.filter(expires_at__lte=now).delete()


def _states_of(keys: list[uuid.UUID]) -> dict:
    return {
        key: (delivered, state, epoch)
        for key, delivered, state, epoch in Session.objects.filter(session__in=keys).values_list(
            "session", "delivered", "state", "epoch"
        )
    }


def _in_reader(function, *args):
    try:
        return function(*args)
    except DatabaseError:
        # A connection the database dropped (a restart) is not reused: the next read opens one.
        connection.close()
        raise


async def read(function, *args):
    """``function(*args)`` in a reader thread."""
    return await asyncio.get_running_loop().run_in_executor(_readers, _in_reader, function, *args)


# --- Wake-ups ---------------------------------------------------------------------------------


def output_changed(session: uuid.UUID) -> None:
    """Tokens of ``session`` were committed by this process: wake its streams now rather than
    at the watcher's next look. Safe from any thread."""
    with _watchers_lock:
        watchers = list(_watchers.values())
    for found in watchers:
        loop = found.loop_ref()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(found.wake, session)
        except RuntimeError:  # that loop is closed
            pass


def watcher() -> OutputWatcher:
    """The watcher of the running event loop."""
    loop = asyncio.get_running_loop()
    with _watchers_lock:
        found = _watchers.get(loop)
        if found is None:
            found = _watchers[loop] = OutputWatcher(loop)
    return found


class OutputWatcher:
    """The streams of one event loop, by session, and the task that looks for their changes."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # Weakly, so that the registry of watchers, keyed by loop, lets a closed loop go.
        self.loop_ref = weakref.ref(loop)
        self._streams: dict[uuid.UUID, set[asyncio.Event]] = {}
        self._seen: dict[uuid.UUID, tuple | None] = {}
        self._rows: set[int] = set()
        self._task: asyncio.Task | None = None

    def watch(self, session: uuid.UUID, row: int | None) -> asyncio.Event:
        """An event set whenever ``session`` may have changed; set at once, so that what
        changed before the stream was watched is read too."""
        event = asyncio.Event()
        event.set()
        self._streams.setdefault(session, set()).add(event)
        if row is not None:
            self._rows.add(row)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._look())
        return event

    def unwatch(self, session: uuid.UUID, event: asyncio.Event, row: int | None) -> None:
        """Forget a stream that ended (its row is deleted when its response closes)."""
        events = self._streams.get(session)
        if events is not None:
            events.discard(event)
            if not events:
                del self._streams[session]
                self._seen.pop(session, None)
        self._rows.discard(row)

    def wake(self, session: uuid.UUID) -> None:
        for event in self._streams.get(session, ()):
            event.set()

    async def _look(self) -> None:
        loop = asyncio.get_running_loop()
        extend_every = settings.KVSP_STREAM_HEARTBEAT_S
        extended_at = loop.time()
        while self._streams:
            await asyncio.sleep(POLL_S)
            sessions = list(self._streams)
            try:
                states = await read(_states_of, sessions)
                if self._rows and loop.time() - extended_at >= extend_every:
                    extended_at = loop.time()
                    await read(_extend_streams, list(self._rows))
            except Exception as exc:  # a database away for a while: look again later
                log.warning("output streams could not read the database: %s", exc)
                continue
            for session in sessions:
                state = states.get(session)
                if session not in self._seen or self._seen[session] != state:
                    self._seen[session] = state
                    self.wake(session)
