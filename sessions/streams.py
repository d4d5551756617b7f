"""What output event streams (``GET sessions/{id}/output`` as server-sent events) share in a
process: wake-ups when their session changes, the threads that read for them, and the rows
that count them against ``KVSP_STREAMS_PER_PRINCIPAL``.

A stream waits on the event loop (``common/asgibridge.py``), not in a thread, and reads the
database only when woken:

- one watcher per event loop reads, every ``POLL_S`` while any stream is open, the delivered
  count and state of every watched session in one query; for a session that changed it reads
  the new tokens once and offers them to all of the session's streams; tokens POSTed to this
  process are read for its streams at once (``output_changed``);
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

from sessions import selectors
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

# The state of a session that no longer exists (its streams end).
_GONE = ("gone",)

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
            key = (_ADVISORY_CLASS << 32) | (principal.id & 0xFFFFFFFF)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])
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


def _output_after(session: uuid.UUID, after: int) -> dict | None:
    """What ``session`` delivered after ``after`` (None once it is gone). Its streams' access
    was checked when they opened: a session never changes scope."""
    row = Session.objects.filter(session=session).first()
    return None if row is None else selectors.output_after(row, after)


def _states_of(keys: list[uuid.UUID]) -> dict:
    """The delivered count, state and epoch of each session of ``keys`` that exists. Asked
    20 times a second by every process with streams open: one plain statement, which costs a
    quarter of the CPU of the same query through the ORM."""
    field = Session._meta.get_field("session")
    quote = connection.ops.quote_name
    columns = ", ".join(quote(name) for name in ("session", "delivered", "state", "epoch"))
    placeholders = ", ".join(["%s"] * len(keys))
    statement = (
        f"SELECT {columns} FROM {quote(Session._meta.db_table)} "  # noqa: S608 - names, not values
        f"WHERE {quote('session')} IN ({placeholders})"
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, [field.get_db_prep_value(key, connection) for key in keys])
        rows = cursor.fetchall()
    return {field.to_python(key): (count, state, epoch) for key, count, state, epoch in rows}


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
    """Tokens of ``session`` were committed by this process: tell its streams now rather than
    at the watcher's next look. Safe from any thread."""
    with _watchers_lock:
        watchers = list(_watchers.values())
    for found in watchers:
        loop = found.loop_ref()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(found.changed, session)
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


class Subscription:
    """One stream's place at the watcher: the tokens offered to it and not yet taken."""

    def __init__(self, after: int):
        self.offered = after
        self.tokens: list[dict] = []
        self.complete = False
        self.gone = False
        self.ready = asyncio.Event()

    def offer(self, answer: dict | None) -> None:
        if answer is None:
            self.gone = True
        else:
            fresh = [token for token in answer["tokens"] if token["index"] > self.offered]
            if fresh:
                self.tokens += fresh
                self.offered = fresh[-1]["index"]
            self.complete = self.complete or answer["complete"]
        if self.tokens or self.complete or self.gone:
            self.ready.set()

    def take(self) -> list[dict]:
        tokens, self.tokens = self.tokens, []
        self.ready.clear()
        return tokens


class OutputWatcher:
    """The streams of one event loop, by session: the task that looks for changes, and one read
    of the new tokens per change of a session, whatever the number of its streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # Weakly, so that the registry of watchers, keyed by loop, lets a closed loop go.
        self.loop_ref = weakref.ref(loop)
        self._streams: dict[uuid.UUID, set[Subscription]] = {}
        self._seen: dict[uuid.UUID, tuple] = {}
        self._rows: set[int] = set()
        self._looking: asyncio.Task | None = None
        self._reading: dict[uuid.UUID, asyncio.Task] = {}
        self._read_again: set[uuid.UUID] = set()

    def subscribe(self, session: uuid.UUID, after: int, row: int) -> Subscription:
        """A stream of ``session`` that has sent every token up to ``after``; what changed
        before it subscribed is read for it at once."""
        subscription = Subscription(after)
        self._streams.setdefault(session, set()).add(subscription)
        self._rows.add(row)
        if self._looking is None or self._looking.done():
            self._looking = asyncio.get_running_loop().create_task(self._look())
        self.changed(session)
        return subscription

    def unsubscribe(self, session: uuid.UUID, subscription: Subscription, row: int) -> None:
        """Forget a stream that ended (its row is deleted when its response closes)."""
        subscriptions = self._streams.get(session)
        if subscriptions is not None:
            subscriptions.discard(subscription)
            if not subscriptions:
                del self._streams[session]
                self._seen.pop(session, None)
        self._rows.discard(row)

    def changed(self, session: uuid.UUID) -> None:
        """Read what ``session`` delivered for its streams (once more if a read is under way)."""
        if session not in self._streams:
            return
        if session in self._reading:
            self._read_again.add(session)
            return
        task = asyncio.get_running_loop().create_task(self._read(session))
        self._reading[session] = task

    async def _read(self, session: uuid.UUID) -> None:
        try:
            while session in self._streams:
                self._read_again.discard(session)
                after = min(s.offered for s in self._streams[session])
                try:
                    answer = await read(_output_after, session, after)
                except Exception as exc:
                    # Looked at again once the watcher sees the database again.
                    log.warning("output streams could not read session %s: %s", session, exc)
                    self._seen.pop(session, None)
                    return
                for subscription in list(self._streams.get(session, ())):
                    subscription.offer(answer)
                if session not in self._read_again:
                    return
        finally:
            del self._reading[session]

    async def _look(self) -> None:
        loop = asyncio.get_running_loop()
        extend_every = settings.KVSP_STREAM_HEARTBEAT_S
        extended_at = loop.time()
        while self._streams:
            await asyncio.sleep(POLL_S)
            sessions = list(self._streams)
            if not sessions:  # the last stream ended meanwhile
                return
            try:
                states = await read(_states_of, sessions)
                if self._rows and loop.time() - extended_at >= extend_every:
                    extended_at = loop.time()
                    await read(_extend_streams, list(self._rows))
            except RuntimeError:  # the process is exiting: its readers take no more work
                return
            except Exception as exc:  # a database away for a while: look again later
                log.warning("output streams could not read the database: %s", exc)
                continue
            for session in sessions:
                # A session seen for the first time is read too: it may have changed between
                # the read its first stream subscribed with and this look.
                state = states.get(session, _GONE)
                if self._seen.get(session) != state:
                    self._seen[session] = state
                    self.changed(session)
