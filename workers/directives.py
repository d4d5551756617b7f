"""Prefetch directives (spec 6.5): accepting one (a row, then a task on the instance's queue;
the same directive sent again is the same row), and carrying it out on the instance's worker:
the blocks the instance does not hold, in prefix order, through the node's one loader
(``workers.loader``: a lease per source, GETs in flight together, every digest verified,
admission and publication in batches). The blocks of a resumed session are loaded the same way.

The worker runs its pool of threads, so a directive never holds up the instance's other work,
and block GETs are served by the HTTP process meanwhile. The directive's progress (the keys
loaded) is written once per batch. Loading stops at the deadline: the directive is then
"partial" with the keys loaded. When no source of a block can serve it, the blocks after it are
useless (keys are chained, 4.2), so loading stops and the directive is "failed" with the reason.

Unless a source failed the block only for now (out of reach, too slow, answering 5xx: the peer
client's policy, ``common.peers``): the task then runs again later, with backoff and while the
deadline allows, and loads what is still missing; its last try, or a load the task does not
drive (a resume's), fails the directive as above.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from common.peers import PeerUnreachable
from common.tasks import RETRYABLE, instance_queue
from kvsp.problems import ProtocolError
from kvsp.records import PrefetchDirective
from kvsp.states import DIRECTIVE_STATES, DirectiveEvent
from workers import loader, metrics, notices, selectors
from workers.instance import lock_node
from workers.models import Directive, DirectiveState, Node, NodeState
from workers.tiers import DeviceTier

log = logging.getLogger(__name__)


def do_accept_directive(directive: PrefetchDirective) -> Directive:
    """Record a directive and queue it for the instance's worker; the same directive sent
    again is the same row, another body under its id a conflict."""
    from workers.tasks import prefetch

    name = selectors.node_name()
    body = directive.to_json()
    directive_id = uuid.UUID(directive.directive)
    with transaction.atomic():
        # Under the node's lock, the same directive sent twice at once (a task and the
        # controller's resend) is one row, never a tripped constraint.
        lock_node(name)
        existing = Directive.objects.filter(instance=name, directive=directive_id).first()
        if existing is not None:
            if existing.body != body:
                raise ProtocolError(
                    "kvsp-conflict", f"directive {directive.directive} exists with another body"
                )
            return existing
        now = timezone.now()
        row = Directive.objects.create(
            instance=name,
            directive=directive_id,
            request_ref=directive.request_ref or "",
            compat_id=bytes.fromhex(directive.compat_id),
            scope_id=bytes.fromhex(directive.scope_id),
            body=body,
            received_at=now,
            deadline_at=now + timedelta(milliseconds=directive.deadline_ms),
        )
        prefetch.apply_async_on_commit(args=[row.pk], queue=instance_queue(name))
    return row


class DirectiveRun:
    """One execution of a directive row; safe to run again (held blocks count as loaded)."""

    def __init__(
        self,
        row: Directive,
        device_tier: DeviceTier | None = None,
        *,
        admitted: bool = False,
        retry_later: bool = False,
    ):
        self.row = row
        # Loading for a session the instance admitted already (a resume, 6.8): it completes
        # even when the instance drains meanwhile (6.3).
        self.admitted = admitted
        # A failure that may pass is raised for the caller to run the directive again.
        self.retry_later = retry_later
        self.directive = PrefetchDirective.from_json(row.body)
        self.name = row.instance
        self.compat_id = bytes(row.compat_id)
        self.scope_id = bytes(row.scope_id)
        self.device_tier = device_tier
        remaining_s = (row.deadline_at - timezone.now()).total_seconds()
        self.deadline = time.monotonic() + remaining_s
        self.loaded: set[str] = set()
        # Blocks this run loaded from peers (held ones were there already), by the tier at the
        # source that served each.
        self.fetched: dict[str, int] = {}
        self.failure: loader.Failure | None = None
        self.deadline_hit = False

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
            loader.Wanted(index, block.block_key, tuple(block.sources))
            for index, block in enumerate(self.directive.blocks)
            if block.block_key not in self.loaded
        ]
        if missing and time.monotonic() < self.deadline:
            run = loader.Loader(
                self.name,
                self.compat_id,
                self.scope_id,
                missing,
                deadline=self.deadline,
                lease_ms=self.directive.lease_ms,
                label=f"directive {self.row.directive}",
                device_tier=self.device_tier,
                on_batch=self._progress,
            ).run()
            self.failure, self.deadline_hit = run.failure, run.deadline_hit
            self.fetched = dict(run.loaded_tiers)
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
        if self.retry_later and self.failure.transient:
            raise PeerUnreachable(self.failure.detail())
        return self.finish(DirectiveEvent.LOAD_FAILED, self.failure.detail())

    def _progress(self, keys: list[str]) -> None:
        """A batch was admitted: the directive's resource says so (one UPDATE), and a
        generation waiting for these blocks is woken (its records are published meanwhile)."""
        self.loaded.update(keys)
        Directive.objects.filter(pk=self.row.pk).update(loaded=self._loaded_in_order())
        notices.notify()

    def _not_loaded(self) -> dict[str, int]:
        """The blocks that did not load, by ``kvsp.reasons.DIRECTIVE_BLOCK_FAILURES``: the
        failed block by its last source's refusal, the others by the deadline when it passed,
        else as past the failure (keys are chained: they were not asked for)."""
        left = len(self.directive.blocks) - len(self._loaded_in_order())
        found: dict[str, int] = {}
        if left and self.failure is not None:
            found[self.failure.why] = 1
            left -= 1
        if left:
            if self.deadline_hit:
                found["deadline"] = found.get("deadline", 0) + left
            else:
                # Past the failure; without one, the instance refused the whole directive.
                found["past_failure" if self.failure is not None else "other"] = left
        return found

    def _all_loaded(self) -> bool:
        return all(key in self.loaded for key in self.directive.block_keys)

    def _loaded_in_order(self) -> list[str]:
        return [key for key in self.directive.block_keys if key in self.loaded]

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
        metrics.count_directive_blocks(self.name, self.fetched, self._not_loaded())
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
    directive_pk: int,
    device_tier: DeviceTier | None = None,
    *,
    admitted: bool = False,
    retry_later: bool = False,
) -> str:
    """Carry out a directive row; a directive already finished is left as it is. ``admitted``:
    the blocks of a session the instance admitted, loaded whatever its state is now.
    ``retry_later``: a block that failed only for now raises PeerUnreachable, the directive
    still pending, rather than failing it (the caller runs it again)."""
    row = Directive.objects.filter(pk=directive_pk).first()
    if row is None:
        return "gone"
    if row.state != DirectiveState.PENDING:
        return row.state
    if row.started_at is None:
        Directive.objects.filter(pk=directive_pk, started_at__isnull=True).update(
            started_at=timezone.now()
        )
    run = DirectiveRun(row, device_tier, admitted=admitted, retry_later=retry_later)
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
