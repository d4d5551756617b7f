"""Placement of one request (spec 6.4) and the prefetch directive that follows it (6.5).

``do_place`` computes the prompt's Block Keys with the scope key, looks the keys up in the
index and prices every active instance that serves the Compatibility ID with the 6.4 cost model
(``placement.pricing.price_prefix``, which failover uses too), and picks the cheapest acceptable
one. When none is acceptable and one is sleeping, it wakes that one and sends it the directive
at once, so that loading overlaps the wake-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import Subquery
from django.utils import timezone

from common.permissions import may_read_scope
from index.metrics import observe_lookup
from index.models import CompatDescriptor, Scope
from index.scopekeys import open_scope_key
from kvsp import blockkeys
from kvsp.cost import CostBreakdown
from kvsp.problems import ProtocolError
from kvsp.reasons import TIERS
from kvsp.records import PlacementRequest
from placement import delivery, policy, pricing, services
from placement.metrics import observe_placement
from placement.models import Directive, Instance, InstanceState
from placement.selectors import candidates


@dataclass
class Timer:
    """Microseconds spent in each step, so that an answer explains where its time went."""

    spent: dict

    def __init__(self):
        self.spent = {}
        self._last = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.spent[step] = round((now - self._last) * 1e6)
        self._last = now


def _candidate_json(instance, price: CostBreakdown) -> dict:
    return {"name": instance.name, "state": instance.state, **price.to_json()}


def do_place(principal, request: PlacementRequest, *, now=None, timer: Timer | None = None) -> dict:
    """The answer to ``POST placements`` (DESIGN.md section 3); ``timer`` started as the
    request arrived, when the caller decoded it."""
    timer = timer or Timer()
    now = now or timezone.now()
    scope_id, compat_id = bytes.fromhex(request.scope_id), bytes.fromhex(request.compat_id)
    # The scope and the block size of its Compatibility ID in one round trip.
    descriptor = CompatDescriptor.objects.filter(compat_id=compat_id).values("block_tokens")
    scope = (
        Scope.objects.filter(scope_id=scope_id)
        .annotate(block_tokens=Subquery(descriptor[:1]))
        .first()
    )
    if scope is None or not may_read_scope(principal, scope_id):
        raise ProtocolError("kvsp-not-found", "no such scope")
    if scope.block_tokens is None:
        raise ProtocolError(
            "kvsp-not-found",
            "no Compatibility Descriptor is registered for compat_id: PUT compat/{id} first",
        )
    block_tokens = scope.block_tokens
    keys = blockkeys.block_keys(
        open_scope_key(scope.scope_id, scope.key_ciphertext),
        compat_id,
        request.tokens,
        block_tokens,
    )
    timer.lap("keys")

    prefix = pricing.price_prefix(
        principal,
        compat_id,
        scope_id,
        keys,
        block_tokens=block_tokens,
        prompt_tokens=len(request.tokens),
        now=now,
        lap=timer.lap,
    )
    matched = prefix.matched
    observe_lookup(
        "placement",
        len(keys),
        matched,
        prefix.hit_tiers(),
        prompt_tokens=len(request.tokens),
        block_tokens=block_tokens,
    )
    priced = prefix.priced
    chosen = pricing.cheapest([e for e in priced if policy.acceptable(e.status, e.price)])
    woke = False
    if chosen is None:
        sleeping = candidates(request.compat_id, states=(InstanceState.SLEEPING,), now=now)
        wake = pricing.cheapest(prefix.price(sleeping))
        if wake is not None:
            services.do_change_state(wake.instance.name, InstanceState.ACTIVE, now=now)
            chosen, woke = wake, True
        else:
            # Nobody has acceptable capacity and nobody sleeps: the least bad active one.
            chosen = pricing.cheapest(priced)
    timer.lap("pricing")
    if chosen is None:
        raise ProtocolError(
            "kvsp-unavailable", "no active or sleeping instance serves this Compatibility ID"
        )

    instance, _, price = chosen
    directive = None
    loads = price.uses_cache or woke
    peer_tiers = [0] * len(TIERS)
    if loads:
        positions, sources, source_of = prefix.directive_sources(chosen)
        if len(positions):
            # Counted before the directive is handed to its sender thread, which would
            # otherwise hold the interpreter while this request still has work to do.
            peer_tiers = prefix.source_tiers(positions, sources, source_of)
            packed = Directive.pack(
                b"".join(map(keys.__getitem__, positions.tolist())), sources, source_of
            )
            directive = _send_directive(instance, request, scope_id, compat_id, packed)
    observe_placement(
        instance.name,
        prompt_tokens=len(request.tokens),
        block_tokens=block_tokens,
        loaded_blocks=price.matched if loads else 0,
        peer_blocks_by_tier=peer_tiers,
        recompute_reason=_recompute_reason(matched, price, loads, prefix.groups),
    )
    timer.lap("directive")
    return {
        "instance": instance.url,
        "name": instance.name,
        "matched": price.matched,
        "directive": directive,
        "woke": woke,
        "candidates": [_candidate_json(i, b) for i, _, b in priced],
        "timings_us": timer.spent,
    }


def _recompute_reason(matched: int, price: CostBreakdown, loads: bool, groups) -> str | None:
    """Why the chosen instance loads nothing (``kvsp.reasons.RECOMPUTE_REASONS``); None when
    it loads some blocks."""
    if loads and price.matched:
        return None
    if not matched:
        return "no_match"
    if price.matched:
        return "recompute_cheaper"
    # Nothing loadable although blocks matched: read only on this path, never on a hit.
    holders = {group.holder for group in groups if 0 in group.positions}
    inactive = Instance.objects.filter(url__in=holders).exclude(state=InstanceState.ACTIVE)
    return "source_inactive" if inactive.count() == len(holders) else "no_link"


def _send_directive(instance, request, scope_id, compat_id, packed: dict) -> str:
    """Record the directive (one INSERT; ``packed``: its blocks as ``Directive.pack`` gives
    them); once it is committed, send it (a row before a message)."""
    directive = Directive.objects.create(
        instance_id=instance.pk,
        request_ref=request.request_ref or "",
        scope_id=scope_id,
        compat_id=compat_id,
        deadline_ms=settings.KVSP_PREFETCH_DEADLINE_MS,
        lease_ms=settings.KVSP_PREFETCH_LEASE_MS,
        **packed,
    )
    transaction.on_commit(lambda: delivery.send_soon(directive))
    return f"{instance.url}prefetch/{directive.directive}"
