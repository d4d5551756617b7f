"""The placement cost model of spec 6.4, and the lookup estimates of 6.2 (DESIGN.md section 3).

This is the reference, one instance block by block; ``kvsp.pricing`` prices a whole fleet at
once with the same figures.

    fetch_us(i)     = max over sources s of ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
                      for blocks not already resident at i
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)
    wait_us(i)      = queued(i) * mean service time at i
    cost(i)         = wait_us(i) + min( fetch_us(i) + recompute_us_of_unmatched(i),
                                        recompute_us_of_all(i) )

Units: rates are in Mbit/s, which is one bit per microsecond, so ``8 * bytes / mbit_per_s`` is
microseconds.

How the terms are filled in where the spec leaves a choice:

- Bytes and tiers. A block fetched from replica r moves ``r.size`` octets. They are split over
  r's residency entries in proportion to the number of layers each entry holds (the layers of
  a block are the same shape, so each layer is an equal share). The share of an entry with a
  ``read_mbit_per_s`` moves at ``min(link rate, read_mbit_per_s)``; the rest at the link rate.
  So the time a source needs is ``rtt_us + sum over its blocks and entries of 8 * share / rate``,
  which is the spec's formula with the tier reduction applied per layer range.
- Usable sources. A holder is a usable source for instance i only when i's status record has a
  link to it: without a rate and a round-trip time there is nothing to price. The instance
  itself is never a source: a replica it holds makes the block resident.
- Resident blocks. A block is resident at i when one of its replicas has i's URL as holder, or
  when the caller says so (``resident``); it costs nothing to fetch.
- Choosing sources. Blocks are assigned in prefix order, greedily: each goes to the usable
  source at which it would finish first, given what that source has already been given
  (``rtt + transfer so far + this block``); ties go to the lower holder URL, so the answer is
  deterministic. This spreads a prefix over parallel sources, which is what ``max over sources``
  rewards. A directive lists a block's usable sources in the order of that finish time.
- The loadable prefix. Blocks are chained (4.2): block j is useless without blocks 0..j-1. For
  placement, ``matched`` is therefore the longest prefix of the looked-up blocks in which every
  block is resident or has a usable source; the blocks after it are recomputed. A lookup
  estimate (6.2) is about making all matched blocks resident, so a target that cannot fetch one
  of them cannot be priced and gets no estimate.
- Mean service time. ``wait_us`` takes it as an input. ``mean_service_time_us`` derives one from
  a status record: a request takes ``prompt / prefill_tokens_per_s + output /
  decode_tokens_per_s`` seconds of the instance's capacity (both rates are aggregates over the
  batch), so a queue of q requests clears in q times that.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsp.records import DirectiveBlock, InstanceStatusRecord, Link, LookupEstimate, ReplicaRecord


def transfer_us(nbytes: int | float, mbit_per_s: int | float) -> float:
    """Microseconds to move ``nbytes`` octets at ``mbit_per_s`` (one Mbit/s = one bit per us)."""
    return 8 * nbytes / mbit_per_s


def recompute_us(tokens: int, prefill_tokens_per_s: int | float) -> float:
    """Microseconds to prefill ``tokens`` tokens (6.4)."""
    return 1e6 * tokens / prefill_tokens_per_s


def wait_us(queued: int, mean_service_time_us: float) -> float:
    """Microseconds a new request waits behind ``queued`` requests (6.4)."""
    return queued * mean_service_time_us


def mean_service_time_us(
    status: InstanceStatusRecord, mean_prompt_tokens: float, mean_output_tokens: float
) -> float:
    """The instance capacity one request uses, in microseconds (see the module docstring)."""
    if mean_prompt_tokens < 0 or mean_output_tokens < 0:
        raise ValueError("token counts cannot be negative")
    return 1e6 * (
        mean_prompt_tokens / status.prefill_tokens_per_s
        + mean_output_tokens / status.decode_tokens_per_s
    )


def replica_transfer_us(replica: ReplicaRecord, link_mbit_per_s: int | float) -> float:
    """Microseconds to move one replica over a link, each layer range at its tier's read rate."""
    layers = sum(entry.layer_count for entry in replica.residency)
    total = 0.0
    for entry in replica.residency:
        rate = link_mbit_per_s
        if entry.read_mbit_per_s is not None:
            rate = min(rate, entry.read_mbit_per_s)
        total += transfer_us(replica.size * entry.layer_count / layers, rate)
    return total


@dataclass(frozen=True, slots=True)
class MatchedBlock:
    """A block the IS matched, in prefix order, with its unexpired replicas (6.2)."""

    block_key: str
    replicas: tuple[ReplicaRecord, ...]

    def __post_init__(self) -> None:
        for replica in self.replicas:
            if replica.block_key != self.block_key:
                raise ValueError(f"a replica of {replica.block_key} listed for {self.block_key}")


@dataclass(frozen=True, slots=True)
class BlockSources:
    """Where one block would be fetched from: usable holders, the cheapest (the chosen) first."""

    block_key: str
    sources: tuple[str, ...]

    @property
    def chosen(self) -> str:
        return self.sources[0]

    def directive_block(self) -> DirectiveBlock:
        return DirectiveBlock(block_key=self.block_key, sources=self.sources)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """The blocks of a prefix an instance can make resident, and how long that takes.

    ``resident`` and ``fetched`` are in prefix order and together are the first ``loadable``
    blocks; ``source_us`` is ``rtt + transfer`` per source used and ``fetch_us`` its maximum.
    """

    loadable: int
    resident: tuple[str, ...]
    fetched: tuple[BlockSources, ...]
    bytes_from: tuple[tuple[str, int], ...]
    source_us: tuple[tuple[str, float], ...]
    fetch_us: float


def plan_fetch(
    instance: str,
    links: Iterable[Link],
    blocks: Sequence[MatchedBlock],
    resident: Collection[str] = (),
) -> FetchPlan:
    """The loadable prefix of ``blocks`` at ``instance`` and the sources to fetch it from."""
    link_by_holder = {link.holder: link for link in links}
    busy_us: dict[str, float] = {}  # transfer time already given to each source
    bytes_from: dict[str, int] = {}
    resident_keys: list[str] = []
    fetched: list[BlockSources] = []
    loadable = 0
    for block in blocks:
        if block.block_key in resident or any(r.holder == instance for r in block.replicas):
            resident_keys.append(block.block_key)
            loadable += 1
            continue
        # (finish time, holder, transfer time, size) for each usable replica, one per holder.
        options: dict[str, tuple[float, str, float, int]] = {}
        for replica in block.replicas:
            link = link_by_holder.get(replica.holder)
            if link is None or replica.holder == instance:
                continue
            cost = replica_transfer_us(replica, link.mbit_per_s)
            finish = link.rtt_us + busy_us.get(replica.holder, 0.0) + cost
            option = (finish, replica.holder, cost, replica.size)
            if replica.holder not in options or option < options[replica.holder]:
                options[replica.holder] = option
        if not options:
            break
        ranked = sorted(options.values())
        _, holder, cost, size = ranked[0]
        busy_us[holder] = busy_us.get(holder, 0.0) + cost
        bytes_from[holder] = bytes_from.get(holder, 0) + size
        fetched.append(BlockSources(block.block_key, tuple(option[1] for option in ranked)))
        loadable += 1
    source_us = {holder: link_by_holder[holder].rtt_us + busy for holder, busy in busy_us.items()}
    return FetchPlan(
        loadable=loadable,
        resident=tuple(resident_keys),
        fetched=tuple(fetched),
        bytes_from=tuple(sorted(bytes_from.items())),
        source_us=tuple(sorted(source_us.items())),
        fetch_us=max(source_us.values(), default=0.0),
    )


@dataclass(frozen=True, slots=True)
class CostBreakdown:
    """The terms of the 6.4 cost of one candidate instance.

    ``matched`` is the number of leading blocks priced as loaded (resident or fetchable).
    ``plan`` says which of them are resident and where each of the others would come from:
    ``price_instance`` gives it; the fleet's pricing (``kvsp.pricing.price_all``) leaves it out
    (None) and works the sources out for the chosen instance alone.
    """

    instance: str
    matched: int
    wait_us: float
    fetch_us: float
    recompute_unmatched_us: float
    recompute_all_us: float
    cost_us: float
    plan: FetchPlan | None = None

    @property
    def uses_cache(self) -> bool:
        """Whether loading the matched prefix beats recomputing everything."""
        return self.matched > 0 and (
            self.fetch_us + self.recompute_unmatched_us < self.recompute_all_us
        )

    def _known_plan(self) -> FetchPlan:
        if self.plan is None:
            raise ValueError(f"{self.instance} was priced without its fetch plan")
        return self.plan

    @property
    def resident(self) -> tuple[str, ...]:
        """The matched blocks already resident at the instance, in prefix order."""
        return self._known_plan().resident

    @property
    def fetch(self) -> tuple[BlockSources, ...]:
        """The other matched blocks, each with where it would come from."""
        return self._known_plan().fetched

    @property
    def bytes_from(self) -> tuple[tuple[str, int], ...]:
        """Octets each source would send."""
        return self._known_plan().bytes_from

    def directive_blocks(self) -> tuple[DirectiveBlock, ...]:
        """The blocks of a prefetch directive (6.5) for this candidate: those to fetch."""
        return tuple(block.directive_block() for block in self.fetch)

    def to_json(self) -> dict[str, Any]:
        """The candidate's terms as in the placement answer (DESIGN.md section 3)."""
        return {
            "instance": self.instance,
            "wait_us": self.wait_us,
            "fetch_us": self.fetch_us,
            "recompute_unmatched_us": self.recompute_unmatched_us,
            "recompute_all_us": self.recompute_all_us,
            "cost_us": self.cost_us,
        }


def price_instance(
    status: InstanceStatusRecord,
    blocks: Sequence[MatchedBlock],
    *,
    block_tokens: int,
    prompt_tokens: int,
    mean_service_time_us: float,
    resident: Collection[str] = (),
) -> CostBreakdown:
    """The 6.4 cost of serving a prompt of ``prompt_tokens`` tokens on the instance of ``status``.

    ``blocks`` are the matched blocks of the prompt in prefix order, as a lookup answers them.
    """
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    if len(blocks) * block_tokens > prompt_tokens:
        raise ValueError("the matched blocks cover more tokens than the prompt has")
    if mean_service_time_us < 0:
        raise ValueError("mean_service_time_us cannot be negative")
    plan = plan_fetch(status.instance, status.links, blocks, resident)
    rate = status.prefill_tokens_per_s
    unmatched = recompute_us(prompt_tokens - plan.loadable * block_tokens, rate)
    everything = recompute_us(prompt_tokens, rate)
    waiting = wait_us(status.queued, mean_service_time_us)
    return CostBreakdown(
        instance=status.instance,
        matched=plan.loadable,
        wait_us=waiting,
        fetch_us=plan.fetch_us,
        recompute_unmatched_us=unmatched,
        recompute_all_us=everything,
        cost_us=waiting + min(plan.fetch_us + unmatched, everything),
        plan=plan,
    )


def cheapest(breakdowns: Iterable[CostBreakdown]) -> CostBreakdown | None:
    """The candidate with the lowest cost; ties go to the lower instance URL (deterministic)."""
    return min(breakdowns, key=lambda b: (b.cost_us, b.instance), default=None)


def lookup_estimate(
    status: InstanceStatusRecord,
    blocks: Sequence[MatchedBlock],
    *,
    block_tokens: int,
    resident: Collection[str] = (),
) -> LookupEstimate | None:
    """The estimate for one lookup target, or None when the IS cannot price it.

    ``fetch_us`` is the time to make every matched block resident at the target and
    ``recompute_us`` the time to prefill the same ``len(blocks) * block_tokens`` tokens there.
    A target without a usable source for some non-resident block cannot be priced.
    """
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    plan = plan_fetch(status.instance, status.links, blocks, resident)
    if plan.loadable < len(blocks):
        return None
    return LookupEstimate(
        target=status.instance,
        fetch_us=plan.fetch_us,
        recompute_us=recompute_us(len(blocks) * block_tokens, status.prefill_tokens_per_s),
    )
