"""What each dashboard page shows.

A page is a tuple of sections. A section is one template under ``templates/dashboard/sections/``
fed by one function of selectors, and may carry charts fed by series of the same selectors. A
page and its live JSON render the same sections, so a refresh shows exactly what a reload
would. A new part of a page is one more ``Section`` in its tuple and one template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import common.metrics
import common.selectors
import index.selectors
import placement.selectors
import sessions.selectors
import workers.selectors
from index.models import Tier
from kvsp.states import INSTANCE_LIFECYCLE, InstanceEvent
from kvsp.timeline import first_token_parts, in_order
from placement.models import Instance, InstanceState, ReshardPhase
from sessions.services import session_json

# The longest span of a chart, the shortest (a young cluster's few points are not squeezed
# against the right edge of an hour), and how many rows a "latest" table lists.
CHART_WINDOW = timedelta(hours=1)
SHORTEST_CHART_WINDOW = timedelta(minutes=5)
RECENT = 20
HOLDER_REPLICAS = 200
LOOKUP_SUMMARY_WINDOW = timedelta(minutes=5)


@dataclass
class Page:
    """What a page is about and when it is drawn; ``return_to`` is where its actions lead back.
    Figures two sections both need are read once per drawing (``once``)."""

    now: datetime
    return_to: str
    instance: Instance | None = None
    session: object = None
    holder: object = None
    _read: dict = field(default_factory=dict, repr=False)

    @property
    def since(self) -> datetime:
        return self.now - CHART_WINDOW

    def once(self, name: str, read: Callable[[], object]):
        if name not in self._read:
            self._read[name] = read()
        return self._read[name]


@dataclass(frozen=True)
class Chart:
    """A chart of lines over the last ``CHART_WINDOW``; ``unit`` tells the script how to scale
    and label the y axis (``ratio`` is drawn from 0 to 1)."""

    name: str
    title: str
    unit: str
    lines: Callable[[Page], list[dict]]


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    template: str
    data: Callable[[Page], dict]
    charts: tuple[Chart, ...] = ()


def ms(moment: datetime) -> int:
    """A time as the charts take it: milliseconds since the epoch."""
    return int(moment.timestamp() * 1000)


def chart_window(page: Page, lines: list[dict]) -> list[int]:
    """[start, end] of a chart in milliseconds: from its first point (at least
    ``SHORTEST_CHART_WINDOW`` back, at most ``CHART_WINDOW``) to now."""
    earliest = min((point[0] for line in lines for point in line["points"]), default=None)
    start = ms(page.now - SHORTEST_CHART_WINDOW)
    if earliest is not None:
        start = max(ms(page.since), min(start, earliest))
    return [start, ms(page.now)]


def _line(name: str, points) -> dict:
    return {"name": name, "points": [[ms(t), v] for t, v in points if v is not None]}


def _seconds_between(earlier: datetime | None, later: datetime) -> float | None:
    return None if earlier is None else (later - earlier).total_seconds()


# --- Instances (6.3) --------------------------------------------------------------------------

# The operator's actions on an instance: the state asked for, and the lifecycle event it is.
# Asking for sleep drains first; the instance sleeps once its sessions are done (6.3).
INSTANCE_ACTIONS = (
    (InstanceState.DRAINING, "Drain", InstanceEvent.DRAIN),
    (InstanceState.SLEEPING, "Sleep", InstanceEvent.DRAIN),
    (InstanceState.ACTIVE, "Wake", InstanceEvent.ACTIVATE),
)


def instance_actions(state: str) -> list[dict]:
    """The actions the lifecycle table allows from ``state``."""
    return [
        {"state": target, "label": label}
        for target, label, event in INSTANCE_ACTIONS
        if INSTANCE_LIFECYCLE.allows(state, event)
    ]


def _instance_row(document: dict) -> dict:
    age_ms = document["last_report_age_ms"]
    document["last_report_age_s"] = None if age_ms is None else age_ms / 1000
    document["actions"] = instance_actions(document["state"])
    return document


def _instances(page: Page) -> list[dict]:
    return page.once(
        "instances",
        lambda: [_instance_row(i) for i in placement.selectors.instances(now=page.now)],
    )


def _instances_data(page: Page) -> dict:
    return {"instances": _instances(page), "return_to": page.return_to}


def _cluster_load_lines(page: Page) -> list[dict]:
    minutes = placement.selectors.cluster_load(page.since)
    return [
        _line("running", ((m["minute"], m["running"]) for m in minutes)),
        _line("queued", ((m["minute"], m["queued"]) for m in minutes)),
    ]


def _cluster_kv_lines(page: Page) -> list[dict]:
    minutes = placement.selectors.cluster_load(page.since)
    return [_line("mean KV utilization", ((m["minute"], m["kv_utilization"]) for m in minutes))]


def _instance_data(page: Page) -> dict:
    instance = page.instance
    document = _instance_row(placement.selectors.instance_figures(instance, now=page.now))
    return {
        "instance": document,
        "registered_at": instance.registered_at,
        "state_changed_at": instance.state_changed_at,
        "failed_at": instance.failed_at,
        "return_to": page.return_to,
    }


def _samples(page: Page):
    return page.once(
        "samples", lambda: placement.selectors.status_samples(page.instance, page.since)
    )


def _instance_load_lines(page: Page) -> list[dict]:
    samples = _samples(page)
    return [
        _line("running", ((s.at, s.running) for s in samples)),
        _line("queued", ((s.at, s.queued) for s in samples)),
    ]


def _instance_kv_lines(page: Page) -> list[dict]:
    return [_line("KV utilization", ((s.at, s.kv_utilization) for s in _samples(page)))]


def _instance_rate_lines(page: Page) -> list[dict]:
    samples = _samples(page)
    return [
        _line("prefill", ((s.at, s.prefill_tokens_per_s) for s in samples)),
        _line("decode", ((s.at, s.decode_tokens_per_s) for s in samples)),
    ]


# --- Replicas (6.1) ---------------------------------------------------------------------------


def _replicas_data(page: Page) -> dict:
    holders = page.once("holders", lambda: index.selectors.replicas_by_holder(now=page.now))
    names = {i["url"]: i["name"] for i in _instances(page)}
    for holder in holders:
        holder["instance"] = names.get(holder["url"])
    return {"holders": holders, "tiers": _tier_names()}


def replica_row(replica, now: datetime) -> dict:
    return {
        "id": replica.pk,
        "block_key": replica.block_key_hex,
        "scope_id": replica.scope_id_hex,
        "compat_id": replica.compat_id_hex,
        "tiers": [tier.label for tier in Tier if replica.tier_mask & tier.value],
        "size": replica.size,
        "refreshed_at": replica.refreshed_at,
        "expires_in_s": (replica.expires_at - now).total_seconds(),
    }


def _tier_names() -> list[str]:
    return [tier.label for tier in Tier]


def _holder_data(page: Page) -> dict:
    holder = page.holder
    instance = next((i for i in _instances(page) if i["url"] == holder.url), None)
    return {
        "holder": holder,
        "instance": instance,
        "figures": index.selectors.replica_tier_totals(holder_id=holder.pk, now=page.now),
        "tiers": _tier_names(),
    }


def _instance_replicas_data(page: Page) -> dict:
    holder = index.selectors.holder_by_url(page.instance.url)
    figures = (
        index.selectors.replica_tier_totals(holder_id=holder.pk, now=page.now) if holder else None
    )
    return {"holder": holder, "figures": figures, "tiers": _tier_names()}


# --- Lookups (6.2) ----------------------------------------------------------------------------


def _lookups_data(page: Page) -> dict:
    minutes = int(LOOKUP_SUMMARY_WINDOW.total_seconds() // 60)
    return {
        "windows": [
            (
                f"last {minutes} minutes",
                index.selectors.lookup_totals(page.now - LOOKUP_SUMMARY_WINDOW),
            ),
            ("last hour", index.selectors.lookup_totals(page.since)),
        ]
    }


def _hit_ratio_lines(page: Page) -> list[dict]:
    buckets = index.selectors.lookup_buckets(page.since)
    return [
        _line("matched blocks / blocks asked", ((b.minute, b.matched_ratio) for b in buckets)),
        _line(
            "lookups with a match / lookups",
            ((b.minute, b.hits / b.lookups if b.lookups else None) for b in buckets),
        ),
    ]


# --- Where the cache hits and why it misses (docs/metrics.md) -----------------------------------

# The tallied counters whose reasons the "why misses" chart draws, and how each line is named.
_MISS_COUNTERS = (
    ("kvsp_prefix_cache_missed_blocks", "lookup stop"),
    ("kvsp_placement_recomputes", "recompute"),
    ("kvsp_directive_block_failures", "block not loaded"),
)


_CACHE_COUNTERS = (
    *(counter for counter, _ in _MISS_COUNTERS),
    "kvsp_placement_tokens",
    "kvsp_prefix_cache_query_blocks",
    "kvsp_prefix_cache_hit_blocks",
    "kvsp_evictions",
)


def _minutes(page: Page) -> dict:
    """The cache's tallied counters per minute over the page's window, read once a drawing."""
    return page.once(
        "counter_minutes", lambda: common.selectors.counter_minutes(_CACHE_COUNTERS, page.since)
    )


def _own(page: Page, labels: tuple) -> bool:
    """Whether a series of a counter with an ``instance`` label is the page's instance's."""
    return page.instance is None or labels[0] == page.instance.name


def _shown_misses(page: Page):
    """The miss counters a page shows: an instance's page, only those counted per instance."""
    return [
        (counter, kind)
        for counter, kind in _MISS_COUNTERS
        if page.instance is None or common.metrics.TALLIED[counter].per_instance
    ]


def _own_series(page: Page, counter: str, labels: tuple) -> bool:
    return not common.metrics.TALLIED[counter].per_instance or _own(page, labels)


def _summed_lines(rows, name_of) -> list[dict]:
    """One line per name ``name_of(labels)`` gives (None: left out), summed per minute."""
    lines: dict[str, dict] = {}
    for minute, labels, value in rows:
        name = name_of(labels)
        if name is not None:
            points = lines.setdefault(name, {})
            points[minute] = points.get(minute, 0) + value
    return [_line(name, sorted(points.items())) for name, points in sorted(lines.items())]


def _why_misses_lines(page: Page) -> list[dict]:
    found = _minutes(page)
    rows = []
    for counter, kind in _shown_misses(page):
        for minute, labels, value in found.get(counter, ()):
            if _own_series(page, counter, labels):
                rows.append((minute, (kind, labels[-1]), value))
    return _summed_lines(rows, lambda labels: f"{labels[0]}: {labels[1]}")


def _cache_tokens_lines(page: Page) -> list[dict]:
    cached = {"own": "from cache (own tiers)", "peer": "from cache (peers)"}
    return _summed_lines(
        _minutes(page).get("kvsp_placement_tokens", ()),
        lambda labels: cached.get(labels[1], "recomputed") if _own(page, labels) else None,
    )


def _tier_hit_ratio_lines(page: Page) -> list[dict]:
    found = _minutes(page)
    asked: dict[datetime, int] = {}
    for minute, _, value in found.get("kvsp_prefix_cache_query_blocks", ()):
        asked[minute] = asked.get(minute, 0) + value
    hits: dict[str, dict] = {}
    for minute, (_, tier), value in found.get("kvsp_prefix_cache_hit_blocks", ()):
        points = hits.setdefault(tier, {})
        points[minute] = points.get(minute, 0) + value
    return [
        _line(tier, ((m, hits[tier].get(m, 0) / n) for m, n in sorted(asked.items()) if n))
        for tier in _tier_names()
        if tier in hits
    ]


def _eviction_lines(page: Page) -> list[dict]:
    return _summed_lines(
        _minutes(page).get("kvsp_evictions", ()),
        lambda labels: (
            (labels[1] if page.instance else f"{labels[0]}: {labels[1]}")
            if _own(page, labels)
            else None
        ),
    )


def _cache_data(page: Page) -> dict:
    """What the last hour added, by reason: the figures of the charts in a table."""
    found = _minutes(page)
    rows = []
    for counter, kind in _shown_misses(page):
        totals: dict[str, int] = {}
        for _, labels, value in found.get(counter, ()):
            if _own_series(page, counter, labels):
                totals[labels[-1]] = totals.get(labels[-1], 0) + value
        rows += [(kind, reason, n) for reason, n in sorted(totals.items())]
    evictions: dict[str, int] = {}
    for _, labels, value in found.get("kvsp_evictions", ()):
        if _own(page, labels):
            evictions[labels[1]] = evictions.get(labels[1], 0) + value
    rows += [("eviction", cause, n) for cause, n in sorted(evictions.items())]
    return {"rows": rows}


# --- Prefetch directives (6.5) ----------------------------------------------------------------


def _directive_row(directive, now: datetime) -> dict:
    return {
        "directive": str(directive.directive),
        "instance": directive.instance.name,
        "request_ref": directive.request_ref,
        "state": directive.state,
        "blocks": directive.block_count,
        "loaded": len(directive.loaded),
        "latency_ms": directive.latency_ms,
        "age_s": _seconds_between(directive.created_at, now),
        "reason": directive.reason or directive.send_error,
    }


def _directives_data(page: Page) -> dict:
    recent = placement.selectors.recent_directives(RECENT, instance=page.instance)
    return {
        "counts": placement.selectors.directive_state_counts(page.instance),
        "directives": [_directive_row(d, page.now) for d in recent],
        "show_instance": page.instance is None,
    }


def _prefetch_latency_lines(page: Page) -> list[dict]:
    minutes = placement.selectors.prefetch_latency(page.since, instance=page.instance)
    return [
        _line("mean", ((m["minute"], m["mean_ms"]) for m in minutes)),
        _line("longest", ((m["minute"], m["max_ms"]) for m in minutes)),
    ]


# --- Leases (6.6) -----------------------------------------------------------------------------


def _leases_data(page: Page) -> dict:
    name = page.instance.name if page.instance else None
    recent = workers.selectors.recent_leases(RECENT, instance=name, now=page.now)
    return {
        "totals": workers.selectors.lease_totals(instance=name, now=page.now),
        "leases": [
            {
                "lease": lease.lease,
                "instance": lease.instance,
                "principal": lease.principal.name,
                "blocks": len(bytes(lease.block_keys)) // 32,
                "octets": lease.octets,
                "expires_in_s": (lease.expires_at - page.now).total_seconds(),
            }
            for lease in recent
        ],
        "show_instance": page.instance is None,
    }


# --- Sessions (6.8) ---------------------------------------------------------------------------


def _session_row(session, now: datetime) -> dict:
    document = session_json(session)
    final = session.final_length
    document["progress"] = session.delivered / final if final else None
    document["updated_s"] = _seconds_between(session.updated_at, now)
    return document


def _sessions_data(page: Page) -> dict:
    recent = sessions.selectors.recent_sessions(2 * RECENT, instance=page.instance)
    return {
        "counts": sessions.selectors.session_state_counts() if page.instance is None else None,
        "sessions": [_session_row(s, page.now) for s in recent],
        "show_instance": page.instance is None,
    }


def _session_data(page: Page) -> dict:
    session = page.session
    document = _session_row(session, page.now)
    checkpoint = session.checkpoint or {}
    return {
        "session": document,
        "scope_id": bytes(session.scope_id).hex(),
        "compat_id": bytes(session.compat_id).hex(),
        "prompt_blocks": len(checkpoint.get("prompt_blocks", ())),
        "sampler": checkpoint.get("sampler"),
        "checkpoints": session.checkpoints,
        "created_at": session.created_at,
        "completed_at": session.completed_at,
        "failed_over_at": session.failed_over_at,
        "resumed_first_token_at": session.resumed_first_token_at,
        "resume_error": session.resume_error,
        "timings_ms": [(step, spent / 1000) for step, spent in in_order(session.timings_us or {})],
        "timings_total_ms": sum((session.timings_us or {}).values()) / 1000,
    }


def _request_row(served, block_tokens: int | None) -> dict:
    row = served.row
    parts, total = first_token_parts(row.timings_us or {})
    own_blocks = row.loaded_blocks - served.peer_blocks
    return {
        "kind": row.kind,
        "epoch": row.epoch,
        "instance": row.instance,
        "state": row.state,
        "own_blocks": own_blocks,
        "peer_blocks": served.peer_blocks,
        "own_tokens": None if block_tokens is None else own_blocks * block_tokens,
        "peer_tokens": None if block_tokens is None else served.peer_blocks * block_tokens,
        "recomputed_tokens": row.recomputed_tokens,
        "first_token_ms": None if total is None else total / 1000,
        "first_token_parts_ms": [(step, spent / 1000) for step, spent in parts],
    }


def _session_requests_data(page: Page) -> dict:
    """The session's own figures, from the rows of the instances that served its requests (a
    generate, then a resume per failover): tokens from cache against recomputed, and the time
    to first token of each with its parts."""
    session = page.session
    descriptor = index.selectors.descriptor(bytes(session.compat_id))
    block_tokens = descriptor.block_tokens if descriptor is not None else None
    requests = [
        _request_row(served, block_tokens)
        for served in workers.selectors.served_requests(session.session)
    ]
    totals = {
        origin: sum(row[origin] or 0 for row in requests)
        for origin in ("own_tokens", "peer_tokens", "recomputed_tokens")
    }
    tokens = sum(totals.values())
    cached = totals["own_tokens"] + totals["peer_tokens"]
    return {
        "requests": requests,
        "totals": totals,
        "from_cache_ratio": cached / tokens if tokens else None,
        "block_tokens": block_tokens,
    }


# --- Shard maps and reshards (6.9) ------------------------------------------------------------


def _shardmaps_data(page: Page) -> dict:
    names = {i["url"]: i["name"] for i in _instances(page)}
    maps = []
    for row in placement.selectors.shard_maps():
        members = sorted({shard["instance"] for shard in row.shards})
        maps.append(
            {
                "map": row.map,
                "version": row.version,
                "shards": len(row.shards),
                "tokens": [row.shards[0]["tokens"][0], row.shards[-1]["tokens"][1]],
                "members": [names.get(url, url) for url in members],
                "updated_at": row.updated_at,
            }
        )
    operations = []
    for operation in placement.selectors.recent_reshard_operations(RECENT):
        operations.append(
            {
                "id": operation.pk,
                "map": operation.shard_map.map,
                "from": operation.from_version,
                "to": operation.to_version,
                "phase": operation.phase,
                "members": len(operation.members),
                "acknowledged": len(operation.acknowledged),
                "informed": len(operation.informed),
                "started_at": operation.started_at,
                "deadline_in_s": (operation.deadline_at - page.now).total_seconds(),
                "reason": operation.reason,
                "can_abort": operation.phase == ReshardPhase.PREPARING,
            }
        )
    return {"maps": maps, "operations": operations, "return_to": page.return_to}


# --- The cluster at a glance ------------------------------------------------------------------


def _summary_data(page: Page) -> dict:
    holders = page.once("holders", lambda: index.selectors.replicas_by_holder(now=page.now))
    return {
        "instances": placement.selectors.instance_state_counts(),
        "replicas": sum(h["replicas"] for h in holders),
        "replica_octets": sum(h["octets"] for h in holders),
        "holders": len(holders),
        "sessions": sessions.selectors.session_state_counts(),
        "failovers": sessions.selectors.failover_total(),
        "directives": placement.selectors.directive_state_counts(),
        "lookups": index.selectors.lookup_totals(page.now - LOOKUP_SUMMARY_WINDOW),
        "lookup_minutes": int(LOOKUP_SUMMARY_WINDOW.total_seconds() // 60),
        "reshards": placement.selectors.reshard_phase_counts(),
    }


def _directives_section(title: str) -> Section:
    return Section(
        "directives",
        title,
        "dashboard/sections/directives.html",
        _directives_data,
        (Chart("prefetch_latency", "Prefetch latency per minute", "ms", _prefetch_latency_lines),),
    )


_SESSIONS = "dashboard/sections/sessions.html"
_LEASES = "dashboard/sections/leases.html"

OVERVIEW = (
    Section("summary", "At a glance", "dashboard/sections/summary.html", _summary_data),
    Section(
        "instances",
        "Instances",
        "dashboard/sections/instances.html",
        _instances_data,
        (
            Chart(
                "load",
                "Requests running and queued (sum over instances)",
                "requests",
                _cluster_load_lines,
            ),
            Chart(
                "kv_utilization", "KV utilization (mean over instances)", "ratio", _cluster_kv_lines
            ),
        ),
    ),
    Section(
        "replicas",
        "Replicas per holder and tier",
        "dashboard/sections/replicas.html",
        _replicas_data,
    ),
    Section(
        "lookups",
        "Lookups",
        "dashboard/sections/lookups.html",
        _lookups_data,
        (Chart("hit_ratio", "Lookup hit ratio per minute", "ratio", _hit_ratio_lines),),
    ),
    Section(
        "cache",
        "Where the cache hits and why it misses",
        "dashboard/sections/cache.html",
        _cache_data,
        (
            Chart("why_misses", "Why misses, per minute", "blocks", _why_misses_lines),
            Chart(
                "cache_tokens",
                "Prompt tokens from cache and recomputed",
                "tokens",
                _cache_tokens_lines,
            ),
            Chart("tier_hits", "Lookup hit ratio per tier", "ratio", _tier_hit_ratio_lines),
            Chart("evictions", "Evictions by cause per holder", "blocks", _eviction_lines),
        ),
    ),
    _directives_section("Prefetch directives"),
    Section("leases", "Leases", _LEASES, _leases_data),
    Section("sessions", "Sessions", _SESSIONS, _sessions_data),
    Section(
        "shardmaps", "Shard maps and reshards", "dashboard/sections/shardmaps.html", _shardmaps_data
    ),
)

INSTANCE = (
    Section(
        "instance",
        "Status",
        "dashboard/sections/instance.html",
        _instance_data,
        (
            Chart("load", "Requests running and queued", "requests", _instance_load_lines),
            Chart("kv_utilization", "KV utilization", "ratio", _instance_kv_lines),
            Chart("rates", "Prefill and decode rates", "tokens/s", _instance_rate_lines),
        ),
    ),
    _directives_section("Prefetch directives sent to it"),
    Section("sessions", "Sessions it serves or served", _SESSIONS, _sessions_data),
    Section(
        "replicas",
        "Replicas it holds",
        "dashboard/sections/instance_replicas.html",
        _instance_replicas_data,
    ),
    Section("leases", "Leases it granted", _LEASES, _leases_data),
    Section(
        "cache",
        "Where its cache hits and why it misses",
        "dashboard/sections/cache.html",
        _cache_data,
        (
            Chart("why_misses", "Why misses, per minute", "blocks", _why_misses_lines),
            Chart(
                "cache_tokens",
                "Prompt tokens placed on it, from cache and recomputed",
                "tokens",
                _cache_tokens_lines,
            ),
            Chart("evictions", "Evictions by cause", "blocks", _eviction_lines),
        ),
    ),
)

SESSION = (
    Section("session", "Session", "dashboard/sections/session.html", _session_data),
    Section(
        "requests",
        "Its requests: tokens from cache and time to first token",
        "dashboard/sections/session_requests.html",
        _session_requests_data,
    ),
)

HOLDER = (Section("holder", "Holder", "dashboard/sections/holder.html", _holder_data),)
