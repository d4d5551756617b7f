"""Sending prefetch directives (spec 6.5), and other messages to instances, at once.

A directive is a row first. The process that committed it POSTs it to the instance at once,
from a small pool of threads of its own, so that loading starts without waiting for a queue and
a worker (and off the placement answer's critical path). When that attempt fails (the instance
is unreachable, answers 5xx, or the process goes away first), the Celery task
``placement.send_directive`` is the path that retries, and the ``resend-pending`` sweep sends
every directive still unaccepted. Sending twice is harmless: the instance keys the directive by
its id.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

import httpx
import orjson
from django.conf import settings
from django.db import close_old_connections, connections, transaction
from django.utils import timezone

from common.peers import PeerUnreachable, call, peer_client, raise_for_problem
from common.tasks import enqueue
from kvsp.problems import ProtocolError
from kvsp.states import DIRECTIVE_STATES, DirectiveEvent
from placement.models import Directive, DirectiveState, InstanceState

log = logging.getLogger(__name__)

_clients = threading.local()


class Senders:
    """A few threads that carry out this process's messages to instances, in order of arrival.

    A sender keeps its database connection while work keeps coming (opening one costs the
    database a new backend, several milliseconds of CPU that a placement after it would wait
    for) and closes it once it has been idle for ``idle_s``, or when ``close`` is called.
    """

    def __init__(self, threads: int, idle_s: float):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._size, self._idle_s = threads, idle_s
        self._lock = threading.Lock()
        self._waiting = 0
        self._closed = False

    def submit(self, work: Callable[[], object]) -> None:
        """Run ``work`` on a sender; RuntimeError once the senders are closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the senders are closed")
            # Another thread when the work already queued would keep every idle one busy.
            if self._work.qsize() >= self._waiting and len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._serve, name=f"kvsp-sender-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        self._work.put(work)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking work; let the senders finish what they hold, close their connections
        and end."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        for thread in threads:
            thread.join(timeout)

    def _serve(self) -> None:
        while True:
            work = self._next()
            if work is None:
                connections.close_all()
                return
            close_old_connections()  # as a request starts: a broken or too old one goes
            try:
                work()
            except Exception:
                log.exception("a message to an instance failed")
            finally:
                close_old_connections()

    def _next(self) -> Callable[[], object] | None:
        with self._lock:
            self._waiting += 1
        try:
            try:
                return self._work.get(timeout=self._idle_s)
            except queue.Empty:
                connections.close_all()  # idle: this thread's own connections
                return self._work.get()
        finally:
            with self._lock:
                self._waiting -= 1


_senders: Senders | None = None
_senders_pid = 0
_senders_lock = threading.Lock()
# How long a sender keeps its database connection without work.
SENDER_IDLE_S = 2.0
# How long an exiting process waits for each sender to finish what is queued.
SENDER_EXIT_S = 5.0


def finish_directive(directive_id: int, event: DirectiveEvent, **fields) -> None:
    """Record the end of a directive still pending; one that ended already stays as it is."""
    with transaction.atomic():
        Directive.objects.filter(pk=directive_id, state__in=DIRECTIVE_STATES.sources(event)).update(
            state=DIRECTIVE_STATES.target(event), finished_at=timezone.now(), **fields
        )


def deliver(directive_id: int, *, client: httpx.Client, document: dict | None = None) -> str:
    """POST prefetch on the chosen instance, never one not active, and follow it once it is
    accepted. Raises ``PeerUnreachable`` when it is worth trying again later; a refusal is final.

    ``document`` is the directive as sent (``Directive.body``) when the caller has it at hand.
    """
    directives = Directive.objects.select_related("instance")
    if document is not None:
        # Thousands of blocks the caller already has.
        directives = directives.defer("block_keys", "sources", "block_sources")
    directive = directives.filter(pk=directive_id).first()
    if directive is None or directive.sent_at is not None:
        return "done"
    if directive.state != DirectiveState.PENDING:
        return directive.state
    if directive.instance.state != InstanceState.ACTIVE:
        finish_directive(
            directive_id, DirectiveEvent.LOAD_FAILED, reason="the instance is not active"
        )
        return "failed"
    content = orjson.dumps(document if document is not None else directive.body())
    response = call(
        client,
        "POST",
        f"{directive.instance.url}prefetch",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    if response.status_code >= 500:
        raise_for_problem(response)  # retried
    if response.status_code != 202:
        try:
            raise_for_problem(response)
            reason = f"the instance answered {response.status_code}"
        except ProtocolError as error:
            reason = error.detail
        finish_directive(directive_id, DirectiveEvent.LOAD_FAILED, reason=reason, send_error=reason)
        return "failed"
    location = response.headers.get("Location", "")
    status_url = str(response.url.join(location)) if location else ""
    Directive.objects.filter(pk=directive_id, sent_at__isnull=True).update(
        sent_at=timezone.now(), status_url=status_url
    )
    from placement.tasks import poll_directive

    enqueue(poll_directive, directive_id, countdown=settings.KVSP_DIRECTIVE_POLL_S)
    return "sent"


def send_soon(directive: Directive) -> None:
    """Send a committed directive now, from this process's senders (call it on commit with the
    row as recorded: the sender writes its document from it, off the caller's path)."""
    try:
        _pool().submit(lambda: _send_or_hand_over(directive))
    except RuntimeError:  # the interpreter is shutting down: the task sends it instead
        _hand_over(directive.pk)


def run_soon(work: Callable[[], object], hand_over: Callable[[], object], what: str) -> None:
    """Run ``work`` (a message to an instance whose row has committed) on this process's
    senders now; when it raises, or cannot start, ``hand_over`` gives it to its task."""

    def attempt() -> None:
        try:
            log.info("%s: %s at once", what, work())
        except Exception as error:
            log.info("%s not done at once (%s): its task retries", what, error)
            hand_over()

    try:
        _pool().submit(attempt)
    except RuntimeError:
        hand_over()


def _pool() -> Senders:
    # One pool per process: a pool made before a fork (gunicorn, Celery) has no threads after.
    global _senders, _senders_pid
    with _senders_lock:
        if _senders is None or _senders_pid != os.getpid():
            _senders = Senders(settings.KVSP_DIRECTIVE_SENDERS, SENDER_IDLE_S)
            _senders_pid = os.getpid()
            # What is queued still goes out as the process exits (the senders are daemons).
            atexit.register(_senders.close, SENDER_EXIT_S)
        return _senders


def close_senders() -> None:
    """Close this process's senders and their database connections (a later send starts new
    ones): for a process that is about to drop or leave its database."""
    global _senders
    with _senders_lock:
        senders, _senders = _senders, None
    if senders is not None and _senders_pid == os.getpid():
        senders.close()


def _client() -> httpx.Client:
    # One client per sender thread, kept: connections to instances stay open between sends.
    client = getattr(_clients, "client", None)
    if client is None:
        timeout = httpx.Timeout(
            settings.KVSP_DIRECTIVE_SEND_TIMEOUT_S,
            connect=min(settings.KVSP_DIRECTIVE_SEND_TIMEOUT_S, 2.0),
        )
        client = _clients.client = peer_client(timeout=timeout)
    return client


def _send_or_hand_over(directive: Directive) -> None:
    directive_id = directive.pk
    try:
        outcome = deliver(directive_id, client=_client(), document=directive.body())
        log.info("directive %s: %s at once", directive_id, outcome)
    except PeerUnreachable as error:
        log.info("directive %s not delivered at once (%s): the task retries", directive_id, error)
        _hand_over(directive_id)
    except Exception:
        log.exception("directive %s not delivered at once: the task retries", directive_id)
        _hand_over(directive_id)


def _hand_over(directive_id: int) -> None:
    from placement.tasks import send_directive

    enqueue(send_directive, directive_id)
