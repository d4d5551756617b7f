"""Carrying out a prefetch directive (spec 6.5) on the instance's worker.

For each block the instance does not hold, in prefix order: hold a lease of ``lease_ms`` at the
first listed source that has the block (a 404 there is a miss: the next source is tried),
retrieve the block in ascending layer order, verify it against that source's Replica Record
from the Index Service (Repr-Digest, each layer digest, the replica digest), place it in the
tiers, publish the instance's own replica, and release the lease. One lease per source covers
all the blocks that list it first, taken before loading starts. A block that fails at one
source is tried at the next; nothing of a refused block is stored.

Several blocks load at once (``KVSP_PREFETCH_PARALLEL``), on threads of their own: the worker
runs its pool of threads, so a directive never holds up the instance's other work, and block
GETs are served by the HTTP process meanwhile. Loading stops at the deadline: the directive is
then "partial" with the keys loaded. When no source of a block can serve it, the blocks after it
are useless (keys are chained, 4.2), so loading stops and the directive is "failed" with the
reason.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.db import close_old_connections, connections, transaction
from django.utils import timezone

from kvsp.problems import ProtocolError
from kvsp.records import DirectiveBlock, LeaseRequest, PrefetchDirective, ReplicaRecord
from kvsp.states import DIRECTIVE_STATES, DirectiveEvent
from kvspsite.celery import RETRYABLE
from kvspsite.peers import PeerUnreachable, peer_client
from workers import control, fetch, notices, selectors, services
from workers.links import LinkMeter
from workers.models import Directive, DirectiveState, Node, NodeState
from workers.tiers import DeviceTier

log = logging.getLogger(__name__)


@dataclass
class _Failure:
    index: int
    block_key: str
    reasons: list[str] = field(default_factory=list)

    def detail(self) -> str:
        tried = "; ".join(self.reasons) or "no source was listed"
        return f"no source could serve block {self.block_key}: {tried}"


class DirectiveRun:
    """One execution of a directive row; safe to run again (held blocks count as loaded)."""

    def __init__(
        self, row: Directive, device_tier: DeviceTier | None = None, *, admitted: bool = False
    ):
        self.row = row
        # Loading for a session the instance admitted already (a resume, 6.8): it completes
        # even when the instance drains meanwhile (6.3).
        self.admitted = admitted
        self.directive = PrefetchDirective.from_json(row.body)
        self.name = row.instance
        self.compat_id = bytes(row.compat_id)
        self.scope_id = bytes(row.scope_id)
        self.device_tier = device_tier
        remaining_s = (row.deadline_at - timezone.now()).total_seconds()
        self.deadline = time.monotonic() + remaining_s
        self.expected: dict[str, dict[str, ReplicaRecord]] = {}
        self.loaded: set[str] = set()
        self.failure: _Failure | None = None
        self.deadline_hit = False
        self.links = LinkMeter()
        # Leases taken ahead at a source for every block that lists it first: source -> lease.
        self.leases: dict[str, fetch.Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> str:
        node = Node.objects.filter(name=self.name).first()
        if not self.admitted and node is not None and node.state != NodeState.ACTIVE:
            return self.finish(
                DirectiveEvent.LOAD_FAILED, f"the instance is not active ({node.state})"
            )
        keys = [bytes.fromhex(k) for k in self.directive.block_keys]
        held = selectors.held_keys(self.name, self.compat_id, self.scope_id, keys)
        self.loaded = {key.hex() for key in held}
        missing = [
            (index, block)
            for index, block in enumerate(self.directive.blocks)
            if block.block_key not in self.loaded
        ]
        if missing and time.monotonic() < self.deadline:
            self._expect([block.block_key for _, block in missing])
            self._load_all(missing)
            self.links.record(self.name)
        if missing and time.monotonic() >= self.deadline and not self._all_loaded():
            self.deadline_hit = True
        if self._all_loaded():
            return self.finish(DirectiveEvent.ALL_LOADED, None)
        if self.deadline_hit or self.failure is None:
            return self.finish(
                DirectiveEvent.DEADLINE_EXPIRED,
                f"the deadline of {self.directive.deadline_ms} ms passed with "
                f"{len(self._loaded_in_order())} of {len(self.directive.blocks)} blocks loaded",
            )
        return self.finish(DirectiveEvent.LOAD_FAILED, self.failure.detail())

    def _all_loaded(self) -> bool:
        return all(key in self.loaded for key in self.directive.block_keys)

    def _loaded_in_order(self) -> list[str]:
        return [key for key in self.directive.block_keys if key in self.loaded]

    def _expect(self, keys: list[str]) -> None:
        """The records of the blocks to load, in one lookup (6.2); the blocks past the matched
        prefix are asked for one by one when they are loaded."""
        try:
            self.expected = control.lookup(self.compat_id, self.scope_id, keys)
        except (PeerUnreachable, ProtocolError) as exc:
            log.warning("directive %s: lookup failed (%s)", self.row.directive, exc)

    def _record_at(self, block_key: str, source: str) -> ReplicaRecord | None:
        records = self.expected.get(block_key)
        if records is None or source not in records:
            try:
                records = control.replicas(self.compat_id, self.scope_id, bytes.fromhex(block_key))
            except (PeerUnreachable, ProtocolError) as exc:
                log.warning("replicas of %s: %s", block_key, exc)
                return None
            with self._lock:
                self.expected[block_key] = records
        return records.get(source)

    def _load_all(self, missing: list[tuple[int, DirectiveBlock]]) -> None:
        queue = iter(missing)
        queue_lock = threading.Lock()

        def loader(client) -> None:
            item = None
            try:
                while not self._stop.is_set():
                    with queue_lock:
                        item = next(queue, None)
                    if item is None:
                        return
                    self._load(client, *item)
            except Exception:
                log.exception("directive %s: a loader failed", self.row.directive)
                index, block = item
                with self._lock:
                    if self.failure is None or index < self.failure.index:
                        reason = "the instance failed while loading it"
                        self.failure = _Failure(index, block.block_key, [reason])
                self._stop.set()
            finally:
                connections.close_all()

        workers = max(1, min(settings.KVSP_PREFETCH_PARALLEL, len(missing)))
        with peer_client() as client:
            self._lease_ahead(client, missing)
            try:
                fetch.in_threads(loader, client, workers, "prefetch")
            finally:
                for lease in self.leases.values():
                    fetch.release_lease(client, lease)

    def _lease_ahead(self, client, missing: list[tuple[int, DirectiveBlock]]) -> None:
        """One lease per source for all the blocks that list it first (6.6 lets a lease name
        many blocks), instead of one per block; a source that refuses it (it lacks one of them,
        or its quota is short) is leased block by block as they load."""
        first: dict[str, list[str]] = {}
        for _, block in missing:
            source = next((s for s in block.sources if s != settings.KVSP_PUBLIC_URL), None)
            if source is not None:
                first.setdefault(source, []).append(block.block_key)
        for source, keys in first.items():
            if len(keys) < 2:
                continue
            request = LeaseRequest(
                compat_id=self.compat_id.hex(),
                scope_id=self.scope_id.hex(),
                block_keys=tuple(keys),
                ttl_ms=self.directive.lease_ms,
            )
            try:
                self.leases[source] = fetch.take_lease(
                    client, source, request, deadline=self.deadline
                )
            except ProtocolError as exc:
                log.info("lease ahead at %s refused (%s): block by block", source, exc.detail)
            except fetch.DeadlineExpired:
                return

    # -- one block ---------------------------------------------------------------------------

    def _load(self, client, index: int, block: DirectiveBlock) -> None:
        reasons = []
        try:
            for source in block.sources:
                reason = self._load_from(client, block.block_key, source)
                if reason is None:
                    with self._lock:
                        self.loaded.add(block.block_key)
                        loaded = self._loaded_in_order()
                    Directive.objects.filter(pk=self.row.pk).update(loaded=loaded)
                    return
                reasons.append(f"{source}: {reason}")
        except fetch.DeadlineExpired:
            self.deadline_hit = True
            self._stop.set()
            return
        with self._lock:
            if self.failure is None or index < self.failure.index:
                self.failure = _Failure(index, block.block_key, reasons)
        self._stop.set()

    def _load_from(self, client, block_key: str, source: str) -> str | None:
        """Load the block from one source; None when it is placed, else why not."""
        if source == settings.KVSP_PUBLIC_URL:
            return "this instance itself"
        if time.monotonic() >= self.deadline:
            raise fetch.DeadlineExpired("the deadline passed")
        record = self._record_at(block_key, source)
        if record is None:
            return "the Index Service lists no replica there"
        ahead = self.leases.get(source)
        lease = None
        if ahead is None or block_key not in ahead.grant.block_keys:
            request = LeaseRequest(
                compat_id=record.compat_id,
                scope_id=record.scope_id,
                block_keys=(block_key,),
                ttl_ms=self.directive.lease_ms,
            )
            try:
                lease = fetch.take_lease(client, source, request, deadline=self.deadline)
            except ProtocolError as exc:
                return exc.detail
        try:
            fetched = fetch.fetch_block(
                client,
                source,
                record,
                max_size=settings.KVSP_MAX_BLOCK_OCTETS,
                deadline=self.deadline,
            )
            fields = services.BlockFields(
                codec=fetched.container.codec,
                size=fetched.size,
                token_count=fetched.container.token_count,
                layer_count=fetched.container.layer_count,
                layer_digests=fetched.layer_digests,
                repr_sha256=fetched.repr_sha256,
            )
            ids = (self.compat_id, self.scope_id, bytes.fromhex(block_key))
            services.do_store_fetched(
                ids, [fetched.buffer], fetched.container, fields, self.device_tier
            )
        except ProtocolError as exc:
            log.warning("block %s from %s refused: %s", block_key, source, exc.detail)
            return exc.detail
        finally:
            if lease is not None:
                fetch.release_lease(client, lease)
            close_old_connections()
        self.links.add(source, fetched.transfer)
        return None

    # -- the end -------------------------------------------------------------------------------

    def finish(self, event: DirectiveEvent, reason: str | None) -> str:
        with transaction.atomic():
            row = Directive.objects.select_for_update().get(pk=self.row.pk)
            if row.state != DirectiveState.PENDING:
                return row.state
            row.state = DIRECTIVE_STATES.next_state(row.state, event)
            row.loaded = self._loaded_in_order()
            row.reason = reason or ""
            row.finished_at = timezone.now()
            row.save(update_fields=["state", "loaded", "reason", "finished_at"])
        notices.notify()
        log.info(
            "directive %s: %s, %d of %d blocks (%s)",
            row.directive,
            row.state,
            len(row.loaded),
            len(self.directive.blocks),
            reason or "",
        )
        return row.state


def run_directive(
    directive_pk: int, device_tier: DeviceTier | None = None, *, admitted: bool = False
) -> str:
    """Carry out a directive row; a directive already finished is left as it is. ``admitted``:
    the blocks of a session the instance admitted, loaded whatever its state is now."""
    row = Directive.objects.filter(pk=directive_pk).first()
    if row is None:
        return "gone"
    if row.state != DirectiveState.PENDING:
        return row.state
    if row.started_at is None:
        Directive.objects.filter(pk=directive_pk, started_at__isnull=True).update(
            started_at=timezone.now()
        )
    run = DirectiveRun(row, device_tier, admitted=admitted)
    notices.notify()  # a generation may be waiting for this directive to arrive
    try:
        return run.run()
    except RETRYABLE:
        raise  # the task runs again; held blocks count as loaded then
    except Exception:
        log.exception("directive %s failed", row.directive)
        return run.finish(
            DirectiveEvent.LOAD_FAILED, "the instance failed to carry out the directive"
        )
