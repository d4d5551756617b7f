"""The one loader of blocks from peers, on the instance's worker: a prefetch directive (spec 6.5),
the blocks of a resumed session (6.8, which the node loads as a directive), and a reshard move's
fetch ranges (6.9).

Per block, in the order given, at the first listed source that can serve it: hold a lease (6.6),
retrieve the block in ascending layer order and verify it against that source's Replica Record
from the Index Service (Repr-Digest, each layer digest, the replica digest), write it to a spool
file in the host tier, and hand it on. A 404 at a source is a miss; a block that fails at one
source is tried at the next; nothing of a refused block is kept. What a source is sent carries a
delegated token for the directive's scope at that source (DESIGN.md section 6), never the node's
own token: a source that is not what it claims learns nothing it could use elsewhere.

The protocol's work is batched, so that the cost per block approaches that of moving and
verifying its octets:

- one lease per source for all the blocks that list it first, taken by the first fetcher that
  needs it (a slow source holds up only its own blocks); a source that refuses it (it lacks one
  of them, or its quota is short) is leased block by block;
- the blocks that list the same source first go to it in batches (docs/api.md "Blocks in batches":
  one request answers up to ``BATCH_GET_BLOCKS`` blocks, or ``BATCH_GET_OCTETS``, each part
  verified as its own GET would be), as many batches as there are fetchers at least; a source
  that answers no batch is asked block by block, with one GET each, from then on;
- ``parallel`` fetchers share one pool of kept-alive connections
  (``common.peers.BlockConnections``, which reads each body from the socket straight into its
  container's buffer), so requests are in flight together and one block's verification
  (hashlib releases the GIL on large buffers) overlaps the others' transfers;
- the calling thread admits what the fetchers have ready to the tier store as one batch, in one
  transaction under one lock of the node, and reports the batch (a directive's progress is one
  UPDATE per batch, and a generation waiting for the blocks may use them from then on); while
  it does, the fetchers go on, so the next batch is whatever arrived meanwhile, and at least one
  block per fetcher still running when they bring them within ``BATCH_WAIT_S``;
- a thread of its own publishes the admitted blocks' records (``publish_all``), everything
  admitted since its last publication in one go, so that no admission, and no generation
  waiting for one, waits for the control plane.

Loading stops at the deadline, at a block no source can serve (keys are chained, 4.2: the blocks
after it are of no use to a prefix) or, for a reshard move, when the move is decided meanwhile;
what was fetched by then is still admitted. A source fails a block as the peer client's policy
says (``common.peers``): out of reach, too slow or answering 5xx is transient, a refusal with
problem details or octets that fail a check final; either way the next source is tried. A block
that failed at some source only transiently is a ``Failure`` that is ``transient``: loading it
again later may succeed, which a directive's task does (``workers.directives``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import connections

from common.peers import BlockConnections, PeerUnreachable, peer_client
from kvsp import reasons
from kvsp.problems import ProtocolError
from kvsp.records import LeaseRequest, ReplicaRecord
from workers import admission, control_plane, fetch, replicas, tiers
from workers.links import LinkMeter

log = logging.getLogger(__name__)

# The most blocks, and octets, one admission takes: a batch waits for nothing, it is what the
# fetchers had ready, and this bounds the octets fetched ahead of the tier store.
BATCH_BLOCKS = 256
BATCH_OCTETS = 256 << 20
# Blocks fetched and not admitted yet, at most: past it, the fetchers wait for the admitter.
AHEAD_BLOCKS = 2 * BATCH_BLOCKS
# An admission and its publication cost a few statements and a request whatever their size, so
# a batch of fewer blocks than there are fetchers waits this long at most for the next ones.
BATCH_WAIT_S = 0.02
# The most blocks, and octets, one request to a source asks for.
BATCH_GET_BLOCKS = 64
BATCH_GET_OCTETS = 8 << 20


@dataclass(frozen=True)
class Wanted:
    """A block to load: its position among the blocks asked for (the first failure, by
    position, is the one reported), its key, and its sources in the order to try them."""

    index: int
    block_key: str
    sources: tuple[str, ...]


@dataclass
class Failure:
    """Why a block could not be loaded: (source, reason) for every source tried; ``transient``
    when a source failed it for a reason that may pass (out of reach, 5xx); ``why``, the reason
    at the last of them as one of ``kvsp.reasons.DIRECTIVE_BLOCK_FAILURES``."""

    index: int
    block_key: str
    reasons: list[tuple[str, str]] = field(default_factory=list)
    transient: bool = False
    why: str = "other"

    def detail(self) -> str:
        tried = "; ".join(f"{source}: {reason}" for source, reason in self.reasons)
        return f"no source could serve block {self.block_key}: {tried or 'no source was listed'}"


class _Refused(Exception):
    """One source could not serve one block (the next source is tried); ``why`` is one of
    ``kvsp.reasons.DIRECTIVE_BLOCK_FAILURES``, and ``transient`` says whether the reason may pass
    (the source, or the control plane, out of reach or answering 5xx)."""

    def __init__(self, detail: str, why: str = "other", *, transient: bool = False):
        super().__init__(detail)
        self.why = why
        self.transient = transient


def refusal_reason(exc: ProtocolError | PeerUnreachable, *, leasing: bool = False) -> str:
    """What a source's refusal of a block was, as ``kvsp.reasons.DIRECTIVE_BLOCK_FAILURES``
    names it; ``leasing`` when it refused the lease."""
    if isinstance(exc, PeerUnreachable) or exc.problem == "kvsp-upstream-error":
        return "holder_unreachable"
    if exc.problem == "kvsp-not-found":
        return "not_found"
    if exc.problem == "kvsp-lease-quota":
        return "over_quota"
    if leasing:
        return "lease_refused"
    if exc.problem in ("kvsp-digest-mismatch", "kvsp-invalid-container"):
        return "digest_mismatch"
    return "other"


@dataclass
class _Arrival:
    wanted: Wanted
    block: admission.LoadedBlock


_DONE = object()  # a fetcher's last word on the queue


class _Publisher(threading.Thread):
    """Publishes the records of admitted blocks: what was submitted while it published the
    last ones goes out together. A publication that fails is retried by the node's keeper
    (the rows are admitted with a retry time)."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self._submitted: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, pks: list[int]) -> None:
        self._submitted.put(pks)

    def finish(self) -> None:
        """Publish what is left, then stop."""
        if self.is_alive():
            self._submitted.put(None)
            self.join()

    def run(self) -> None:
        try:
            done = False
            while not done:
                first = self._submitted.get()
                done = first is None
                pks = list(first or ())
                while not done and not self._submitted.empty():
                    more = self._submitted.get()
                    if more is None:
                        done = True
                    else:
                        pks += more
                if pks:
                    try:
                        replicas.publish_all(pks)
                    except Exception:  # noqa: BLE001 - the keeper publishes them later
                        log.exception("publishing %d admitted blocks failed", len(pks))
        finally:
            connections.close_all()


class Loader:
    """One run of loading blocks into this node. ``check`` may refuse a verified block
    (raising ProtocolError) before it is kept; ``on_batch`` is told the keys of every batch
    admitted; ``pending_move_id`` admits the blocks pending for that reshard move, unpublished.
    ``loaded_tiers`` counts the blocks admitted by the fastest tier they were in at the source
    that served them (``kvsp.reasons.TIERS``).
    """

    def __init__(
        self,
        instance: str,
        compat_id: bytes,
        scope_id: bytes,
        wanted: list[Wanted],
        *,
        deadline: float,
        lease_ms: int,
        label: str,
        device_tier: tiers.DeviceTier | None = None,
        pending_move_id: int | None = None,
        check: Callable[[fetch.FetchedBlock], None] | None = None,
        on_batch: Callable[[list[str]], None] | None = None,
    ):
        self.instance = instance
        self.compat_id = compat_id
        self.scope_id = scope_id
        self.wanted = wanted
        self.deadline = deadline
        self.lease_ms = lease_ms
        self.label = label
        self.device_tier = device_tier
        self.pending_move_id = pending_move_id
        self.check = check
        self.on_batch = on_batch
        # What the run came to.
        self.loaded: set[str] = set()
        self.failure: Failure | None = None
        self.deadline_hit = False
        self.decided = False
        self.links = LinkMeter()
        self._expected: dict[str, dict[str, ReplicaRecord]] = {}
        self._leases: dict[str, fetch.Lease | None] = {}
        self._lease_keys: dict[str, list[str]] = {}
        self._source_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._arrivals: queue.Queue = queue.Queue(maxsize=AHEAD_BLOCKS)
        self._running = 0  # fetchers that have not said _DONE yet
        self._connections: BlockConnections | None = None
        self._unbatched: set[str] = set()  # sources that answer no batch of blocks
        # The fastest tier of each fetched block at the source that served it, for ``tiers``.
        self._source_tier: dict[str, str] = {}
        self.loaded_tiers: Counter[str] = Counter()
        self._publisher = _Publisher(f"{label}-publish")

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> Loader:
        if not self.wanted:
            return self
        for item in self.wanted:
            first = self._first_source(item)
            if first is not None:
                self._lease_keys.setdefault(first, []).append(item.block_key)
        work_lock = threading.Lock()
        count = max(1, min(settings.KVSP_PREFETCH_PARALLEL, len(self.wanted)))
        # No token of the node's own: each request to a source carries the delegated token for
        # the scope and that source (DESIGN.md section 6), which grants nothing beyond them.
        # Leases and releases through httpx; the GETs, the bulk of the requests, through
        # kept-alive connections that read each body straight into its container's buffer.
        self._connections = BlockConnections()
        with peer_client(token="") as client, self._connections:
            # Each source's token and lease are asked for while the IS is asked for the
            # records: the first GETs wait for neither round trip after the other.
            leasing = [
                threading.Thread(
                    target=self._lease_ahead, args=(client, source), name=f"{self.label}-lease"
                )
                for source in self._lease_keys
            ]
            for thread in leasing:
                thread.start()
            self._expect([item.block_key for item in self.wanted])
            work = iter(self._batches(count))
            threads = [
                threading.Thread(
                    target=self._fetcher,
                    args=(client, work, work_lock),
                    name=f"{self.label}-fetch-{index}",
                )
                for index in range(count)
            ]
            for thread in threads:
                thread.start()
            self._running = count
            self._publisher.start()
            try:
                self._admit_arrivals()
            finally:
                self._stop.set()
                self._discard_arrivals()
                for thread in threads + leasing:
                    thread.join()
                self._publisher.finish()
                for source, lease in self._leases.items():
                    if lease is not None:
                        self._release(client, source, lease)
        self.links.record(self.instance)
        return self

    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self.failure is None or failure.index < self.failure.index:
                self.failure = failure
        self._stop.set()

    def _expect(self, keys: list[str]) -> None:
        """The records of the blocks to load, in one lookup (6.2); a block past the matched
        prefix of the list is asked for on its own when it is loaded."""
        try:
            self._expected = control_plane.lookup(self.compat_id, self.scope_id, keys)
        except (PeerUnreachable, ProtocolError) as exc:
            log.warning("%s: lookup failed (%s)", self.label, exc)

    # -- the calling thread: admission in batches --------------------------------------------

    def _admit_arrivals(self) -> None:
        """Admit what arrives, a batch at a time, until every fetcher has stopped."""
        while self._running:
            batch: list[_Arrival] = []
            octets = 0
            item = self._arrivals.get()
            wait_until = time.monotonic() + BATCH_WAIT_S
            while True:
                if item is _DONE:
                    self._running -= 1
                else:
                    batch.append(item)
                    octets += item.block.fields.size
                if not self._running or len(batch) >= BATCH_BLOCKS or octets >= BATCH_OCTETS:
                    break
                try:
                    item = self._arrivals.get_nowait()
                except queue.Empty:
                    left = wait_until - time.monotonic()
                    if len(batch) >= self._running or left <= 0:
                        break
                    try:
                        item = self._arrivals.get(timeout=left)
                    except queue.Empty:
                        break
            if batch:
                self._admit(batch)

    def _discard_arrivals(self) -> None:
        """After admission stopped early (it failed): what the fetchers still bring is not
        kept, and none of them waits on a full queue."""
        while self._running:
            item = self._arrivals.get()
            if item is _DONE:
                self._running -= 1
            else:
                tiers.unlink_quietly(item.block.spool)

    def _admit(self, batch: list[_Arrival]) -> None:
        try:
            if self.decided:
                return
            try:
                stored = admission.do_admit_loaded(
                    [arrival.block for arrival in batch], self.pending_move_id
                )
            except ProtocolError as exc:
                # The tier store refused the batch (no room): each block on its own, so that
                # what fits is kept and the first that does not is the failure reported.
                if len(batch) == 1:
                    arrival = batch[0]
                    self._fail(
                        Failure(
                            arrival.wanted.index,
                            arrival.wanted.block_key,
                            [("this instance", exc.detail)],
                            "no_room",
                        )
                    )
                    return
                for arrival in batch:
                    self._admit([arrival])
                return
            if stored is None:
                self.decided = True
                self._stop.set()
                return
            keys = [arrival.wanted.block_key for arrival in batch]
            with self._lock:
                self.loaded.update(keys)
                self.loaded_tiers.update(self._source_tier.get(key, "other") for key in keys)
            if self.on_batch is not None:
                self.on_batch(keys)
            if self.pending_move_id is None:
                self._publisher.submit(stored)
        finally:
            for arrival in batch:
                tiers.unlink_quietly(arrival.block.spool)

    # -- the fetchers ------------------------------------------------------------------------

    def _batches(self, fetchers: int):
        """The blocks in order, in runs that a fetcher asks one source for in one request: the
        same first source, its record known, at most ``BATCH_GET_BLOCKS`` blocks and
        ``BATCH_GET_OCTETS`` octets, and no more than an even share among ``fetchers``, so
        that every fetcher has a batch of its own."""
        share = max(1, min(BATCH_GET_BLOCKS, -(-len(self.wanted) // fetchers)))
        batch: list[Wanted] = []
        source, octets = None, 0
        for item in self.wanted:
            first = self._first_source(item)
            record = self._expected.get(item.block_key, {}).get(first)
            size = record.size if record is not None else BATCH_GET_OCTETS
            if batch and (
                first != source or len(batch) >= share or octets + size > BATCH_GET_OCTETS
            ):
                yield batch
                batch, octets = [], 0
            batch.append(item)
            source, octets = first, octets + size
        if batch:
            yield batch

    @staticmethod
    def _first_source(item: Wanted) -> str | None:
        return next((s for s in item.sources if s != settings.KVSP_PUBLIC_URL), None)

    def _fetcher(self, client, work, work_lock) -> None:
        batch = None
        try:
            while not self._stop.is_set():
                with work_lock:
                    batch = next(work, None)
                if batch is None:
                    return
                self._load_batch(client, batch)
        except Exception:
            log.exception("%s: a fetcher failed", self.label)
            if batch:
                item = batch[0]
                self._fail(
                    Failure(item.index, item.block_key, [("this instance", "it failed loading")])
                )
            self._stop.set()
        finally:
            connections.close_all()
            self._arrivals.put(_DONE)

    def _load_batch(self, client, batch: list[Wanted]) -> None:
        """Load ``batch`` from its first source in one request where it can, and each block
        that fails there, or that the request did not bring, on its own from the sources after
        it (or, when the source answered no batch, from every source)."""
        left = {item.block_key: item for item in batch}
        outcomes = self._fetch_batch(client, batch)
        try:
            for item, outcome in outcomes:
                del left[item.block_key]
                if isinstance(outcome, admission.LoadedBlock):
                    self._arrivals.put(_Arrival(item, outcome))
                else:
                    source, refused = outcome
                    self._load(client, item, [(source, refused)], after=source)
                if self._stop.is_set():
                    return
        except fetch.DeadlineExpired:
            self.deadline_hit = True
            self._stop.set()
            return
        finally:
            outcomes.close()  # a request left unread is not kept alive
        for item in batch:
            if self._stop.is_set():
                return
            if item.block_key in left:
                self._load(client, item)

    def _fetch_batch(self, client, batch: list[Wanted]):
        """(block, its LoadedBlock or the (source, _Refused) it was refused with) for the blocks
        of ``batch`` that its first source answered in one request; none when it could not be
        asked for them so (a single block, an unknown record, no lease, no token, no batches
        at that source) or answered otherwise."""
        source = self._first_source(batch[0])
        if len(batch) < 2 or source is None or source in self._unbatched:
            return
        records = [self._expected.get(item.block_key, {}).get(source) for item in batch]
        if any(record is None for record in records) or time.monotonic() >= self.deadline:
            return
        lease = self._lease_at(client, source)
        if lease is None or not {item.block_key for item in batch} <= set(lease.grant.block_keys):
            return
        try:
            token = self._token(source)
        except _Refused:
            return
        items = {item.block_key: item for item in batch}
        try:
            for record, outcome in fetch.fetch_blocks(
                self._connections,
                source,
                records,
                max_size=settings.KVSP_MAX_BLOCK_OCTETS,
                token=token,
                deadline=self.deadline,
            ):
                item = items[record.block_key]
                if isinstance(outcome, ProtocolError | PeerUnreachable):
                    yield item, (source, self._refused(item.block_key, source, outcome))
                    continue
                try:
                    yield item, self._keep(item.block_key, source, outcome)
                except _Refused as exc:
                    yield item, (source, exc)
        except fetch.BatchRefused as exc:
            if exc.unsupported:
                self._unbatched.add(source)
            log.info("%s: %s: block by block", self.label, exc)
        except (ProtocolError, PeerUnreachable) as exc:
            log.warning("%s: a batch from %s broke off: %s", self.label, source, exc)

    def _load(
        self,
        client,
        item: Wanted,
        refusals: list[tuple[str, _Refused]] | None = None,
        *,
        after: str | None = None,
    ) -> None:
        """Load ``item`` on its own from its sources in order (those after ``after`` when
        given), adding to ``refusals`` why each refused it."""
        refusals = list(refusals or [])
        sources = list(item.sources)
        if after is not None:
            sources = sources[sources.index(after) + 1 :]
        try:
            for source in sources:
                try:
                    block = self._load_from(client, item.block_key, source)
                except _Refused as exc:
                    refusals.append((source, exc))
                    continue
                self._arrivals.put(_Arrival(item, block))
                return
        except fetch.DeadlineExpired:
            self.deadline_hit = True
            self._stop.set()
            return
        self._fail(
            Failure(
                item.index,
                item.block_key,
                [(source, str(refused)) for source, refused in refusals],
                transient=any(refused.transient for _, refused in refusals),
                why=refusals[-1][1].why if refusals else "other",
            )
        )

    def _token(self, source: str) -> str:
        """The delegated token for this scope at ``source``; _Refused when there is none."""
        try:
            return control_plane.delegated_token(self.scope_id, source)
        except (PeerUnreachable, ProtocolError) as exc:
            raise _Refused(
                f"the control plane gave no token for it ({exc})",
                transient=isinstance(exc, PeerUnreachable),
            ) from exc

    def _release(self, client, source: str, lease: fetch.Lease) -> None:
        try:
            token = self._token(source)
        except _Refused:
            return  # the lease expires on its own after its TTL
        fetch.release_lease(client, lease, token=token)

    def _record_at(self, block_key: str, source: str) -> ReplicaRecord | None:
        records = self._expected.get(block_key)
        if records is None or source not in records:
            try:
                records = control_plane.replicas(
                    self.compat_id, self.scope_id, bytes.fromhex(block_key)
                )
            except (PeerUnreachable, ProtocolError) as exc:
                raise _Refused(
                    f"the Index Service could not say where it is ({exc})",
                    transient=isinstance(exc, PeerUnreachable),
                ) from exc
            with self._lock:
                self._expected[block_key] = records
        return records.get(source)

    def _lease_ahead(self, client, source: str) -> None:
        try:
            self._lease_at(client, source)
        except fetch.DeadlineExpired:
            pass  # the fetchers see it too
        except Exception:  # noqa: BLE001 - a fetcher that needs the lease asks again
            log.exception("%s: the lease at %s could not be asked for", self.label, source)
        finally:
            connections.close_all()

    def _lease_at(self, client, source: str) -> fetch.Lease | None:
        """The lease at ``source`` for every block that lists it first, taken once; None when
        the source refused it."""
        keys = self._lease_keys.get(source)
        if not keys:
            return None
        with self._lock:
            lock = self._source_locks.setdefault(source, threading.Lock())
        with lock:
            if source not in self._leases:
                request = LeaseRequest(
                    compat_id=self.compat_id.hex(),
                    scope_id=self.scope_id.hex(),
                    block_keys=tuple(keys),
                    ttl_ms=self.lease_ms,
                )
                try:
                    self._leases[source] = fetch.take_lease(
                        client, source, request, token=self._token(source), deadline=self.deadline
                    )
                except (ProtocolError, PeerUnreachable, _Refused) as exc:
                    log.info(
                        "%s: lease at %s refused (%s): block by block",
                        self.label,
                        source,
                        exc,
                    )
                    self._leases[source] = None
            return self._leases[source]

    def _load_from(self, client, block_key: str, source: str) -> admission.LoadedBlock:
        """Fetch and verify the block at one source and spool it; _Refused says why not."""
        if source == settings.KVSP_PUBLIC_URL:
            raise _Refused("this instance itself")
        if time.monotonic() >= self.deadline:
            raise fetch.DeadlineExpired("the deadline passed")
        record = self._record_at(block_key, source)
        if record is None:
            raise _Refused("the Index Service lists no replica there", "not_found")
        ahead = self._lease_at(client, source)
        token = self._token(source)
        lease = None
        try:
            if ahead is None or block_key not in ahead.grant.block_keys:
                request = LeaseRequest(
                    compat_id=record.compat_id,
                    scope_id=record.scope_id,
                    block_keys=(block_key,),
                    ttl_ms=self.lease_ms,
                )
                try:
                    lease = fetch.take_lease(
                        client, source, request, token=token, deadline=self.deadline
                    )
                except (ProtocolError, PeerUnreachable) as exc:
                    raise self._refused(block_key, source, exc, leasing=True) from exc
            fetched = fetch.fetch_block(
                self._connections,
                source,
                record,
                max_size=settings.KVSP_MAX_BLOCK_OCTETS,
                token=token,
                deadline=self.deadline,
            )
        except (ProtocolError, PeerUnreachable) as exc:
            raise self._refused(block_key, source, exc) from exc
        finally:
            if lease is not None:
                fetch.release_lease(client, lease, token=token)
        return self._keep(block_key, source, fetched)

    def _refused(
        self,
        block_key: str,
        source: str,
        exc: ProtocolError | PeerUnreachable,
        *,
        leasing: bool = False,
    ) -> _Refused:
        """Why ``source`` did not give ``block_key`` (``leasing``: it refused the lease),
        logged; a token it refused is not presented again."""
        log.warning("%s: block %s from %s refused: %s", self.label, block_key, source, exc)
        why = refusal_reason(exc, leasing=leasing)
        if isinstance(exc, PeerUnreachable):
            return _Refused(str(exc), why, transient=True)
        if exc.problem == "kvsp-unauthenticated":
            control_plane.forget_delegated_token(self.scope_id, source)
        return _Refused(exc.detail, why)

    def _keep(self, block_key: str, source: str, fetched: fetch.FetchedBlock):
        """A verified block, checked (``check``), its device copy prepared and its octets
        spooled: the LoadedBlock to admit; _Refused says why not."""
        ids = (self.compat_id, self.scope_id, bytes.fromhex(block_key))
        try:
            if self.check is not None:
                self.check(fetched)
            install = None
            if self.pending_move_id is None:
                install = admission.prepare_device_copy(ids, fetched.container, self.device_tier)
        except ProtocolError as exc:
            raise self._refused(block_key, source, exc) from exc
        fields = admission.BlockFields(
            codec=fetched.container.codec,
            size=fetched.size,
            token_count=fetched.container.token_count,
            layer_count=fetched.container.layer_count,
            layer_digests=fetched.layer_digests,
            repr_sha256=fetched.repr_sha256,
        )
        spool = tiers.write_spool(self.instance, [fetched.buffer])
        self.links.add(source, fetched.transfer)
        record = self._expected.get(block_key, {}).get(source)
        if record is not None:
            served_from = reasons.fastest(entry.tier for entry in record.residency)
            with self._lock:
                self._source_tier[block_key] = served_from
        return admission.LoadedBlock(ids, spool, fields, install)
