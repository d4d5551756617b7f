"""``KVSPConnector``: vLLM's v1 KV connector API (``KVConnectorBase_V1``) spoken in KVSP.

Scheduler side: for each new request, the Block Keys of the prompt's complete blocks (the scope
key from ``GET CP scopes/{scope}/key``, the Compatibility ID of the descriptor built from vLLM's
model directory by ``kvsp.compat``, ``block_tokens`` = vLLM's block size), one lookup at the
IS, and the number of tokens that will load, asynchronously: the request waits in vLLM's
``WAITING_FOR_REMOTE_KVS`` state while the worker loads, and the engine runs other requests.
The last prompt token is always computed, so at most ``(len(prompt) - 1) // block_size``
blocks load. Each step it also lists the complete blocks the step computes, to be stored.

Worker side: each block is fetched from a holder that the lookup listed (the local node first),
layer by layer; a layer is written into the block vLLM allocated only after it matched its
layer digest in the Replica Record, and the block counts as loaded only after the whole
representation matched Repr-Digest and the layer digests the replica digest. Blocks computed
by a step are read out of the cache when the step ends and stored at the local node
(``PUT blocks/...`` with ``If-None-Match: *``), which publishes them to the IS.

Any failure to load (a miss, a refusal, a digest mismatch, a holder down, the deadline) reports
the block, and those after it, to vLLM as failed; with ``kv_load_failure_policy: "recompute"``
vLLM computes those tokens itself. A failure to store is logged and costs only a later miss.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvsp.blockkeys import BlockKeyChain
from kvsp.compat import compat_id_hex, descriptor_from_model_dir
from kvsp.container import Layer, header_size
from kvsp.problems import ProtocolError
from kvsp.records import ReplicaRecord
from kvsp.tensors import encode_tensors, kv_dtype_of, section_size, tensor_from_section
from kvsp_vllm.client import FETCHES_AT_ONCE, KvspClient, MatchedBlock, PeerError
from kvsp_vllm.layouts import Geometry, PagedLayout, layout_for
from kvsp_vllm.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


# -- what the scheduler side tells the worker side each step ------------------------------------


@dataclass
class LoadBlock:
    block_key: str
    block_id: int
    # Replica Records as JSON, so that the metadata crosses process boundaries as plain data.
    replicas: list[dict]


@dataclass
class LoadSpec:
    request_id: str
    blocks: list[LoadBlock]


@dataclass
class StoreBlock:
    block_key: str
    block_id: int


@dataclass
class KVSPConnectorMetadata(KVConnectorMetadata):
    compat_id: str
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreBlock] = field(default_factory=list)


# -- what both sides derive from vLLM's configuration -------------------------------------------


@dataclass(frozen=True)
class EngineGeometry:
    layers: int
    kv_dtype: str
    block: Geometry

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> EngineGeometry:
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                "the KVSP connector supports tensor and pipeline parallel size 1, not "
                f"{parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}"
            )
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto":
            raise ValueError(
                f"the KVSP connector needs the cache in the model's dtype (kv_cache_dtype "
                f"'auto'), not {cache_dtype!r}"
            )
        model = vllm_config.model_config
        return cls(
            layers=model.get_num_layers(parallel),
            kv_dtype=kv_dtype_of(model.dtype),
            block=Geometry(
                block_tokens=vllm_config.cache_config.block_size,
                kv_heads=model.get_num_kv_heads(parallel),
                head_dim=model.get_head_size(),
            ),
        )

    @property
    def container_size(self) -> int:
        g = self.block
        return header_size(self.layers) + 2 * self.layers * section_size(
            self.kv_dtype, g.block_tokens, g.kv_heads, g.head_dim
        )


def engine_descriptor(vllm_config: VllmConfig, settings: ConnectorSettings) -> dict:
    """The Compatibility Descriptor of the engine's model, as ``python -m kvsp descriptor``
    and the reference engine compute it, checked against the geometry vLLM runs."""
    model_config = vllm_config.model_config
    directory = Path(model_config.model)
    if not directory.is_dir():
        raise ValueError(
            f"the KVSP connector computes the Compatibility ID from the model's files; "
            f"{model_config.model!r} is not a local directory"
        )
    geometry = EngineGeometry.of(vllm_config)
    name = settings.model or model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0]
    descriptor = descriptor_from_model_dir(
        directory,
        model=name,
        kv_dtype=geometry.kv_dtype,
        block_tokens=geometry.block.block_tokens,
    )
    running = (geometry.layers, geometry.block.kv_heads, geometry.block.head_dim)
    described = (descriptor["layers"], descriptor["kv_heads"], descriptor["head_dim"])
    if running != described:
        raise ValueError(
            f"vLLM runs {running} (layers, kv_heads, head_dim), config.json describes {described}"
        )
    return descriptor


# -- the scheduler side -------------------------------------------------------------------------


@dataclass
class _RequestPlan:
    request: Request
    chain: BlockKeyChain
    keys: list[str]
    hashed_tokens: int
    matched: list[MatchedBlock]
    # Blocks below this index exist in KVSP or are being loaded: never stored again.
    stored: int
    local_tokens: int = 0
    # One load per request: after a load that failed vLLM asks again, and computing is the
    # answer then; offering the same blocks again could repeat the failure without end.
    load_issued: bool = False


class _SchedulerSide:
    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig):
        self.settings = settings
        self.block_tokens = vllm_config.cache_config.block_size
        self.compat_id = compat_id_hex(engine_descriptor(vllm_config, settings))
        self.client = KvspClient(settings.control_url, settings.token)
        self._scope_key: bytes | None = None
        self._plans: dict[str, _RequestPlan] = {}
        self._loads: list[LoadSpec] = []
        self.kv_cache_manager = None
        log.info("KVSP connector: compat %s, scope %s", self.compat_id, settings.scope_id)

    def _key(self) -> bytes:
        if self._scope_key is None:
            self._scope_key = self.client.scope_key(self.settings.scope_id)
        return self._scope_key

    def _plan(self, request: Request) -> _RequestPlan | None:
        plan = self._plans.get(request.request_id)
        if plan is not None:
            return plan
        try:
            chain = BlockKeyChain(self._key(), bytes.fromhex(self.compat_id), self.block_tokens)
        except (PeerError, ProtocolError) as error:
            log.warning(
                "KVSP: no scope key, request %s is computed whole: %s", request.request_id, error
            )
            return None
        prompt = list(request.prompt_token_ids or ())
        loadable = max(len(prompt) - 1, 0) // self.block_tokens * self.block_tokens
        keys = [key.hex() for key in chain.extend(prompt[:loadable])]
        matched: list[MatchedBlock] = []
        if keys:
            try:
                matched = self.client.lookup(self.settings.scope_id, self.compat_id, keys)
            except PeerError as error:
                log.warning("KVSP: lookup failed, request recomputes: %s", error)
        plan = _RequestPlan(request, chain, keys, loadable, matched, stored=len(matched))
        self._plans[request.request_id] = plan
        return plan

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        plan = self._plan(request)
        if plan is None or plan.load_issued or num_computed_tokens % self.block_tokens:
            return 0, False
        plan.local_tokens = num_computed_tokens
        hit = len(plan.matched) * self.block_tokens
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, external_tokens: int) -> None:
        if external_tokens <= 0:
            return
        plan = self._plans[request.request_id]
        block_ids = blocks.get_block_ids()[0]
        first = plan.local_tokens // self.block_tokens
        count = external_tokens // self.block_tokens
        self._loads.append(
            LoadSpec(
                request.request_id,
                [
                    LoadBlock(
                        matched.block_key,
                        block_ids[first + index],
                        [record.to_json() for record in matched.replicas],
                    )
                    for index, matched in enumerate(plan.matched[first : first + count])
                ],
            )
        )
        plan.stored = max(plan.stored, first + count)
        plan.load_issued = True

    def _computed_after_step(self, output: SchedulerOutput):
        for new in output.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens + output.num_scheduled_tokens[new.req_id]
        cached = output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            yield req_id, computed + output.num_scheduled_tokens[req_id]

    def _blocks_to_store(self, request_id: str, plan: _RequestPlan, computed: int):
        tokens = plan.request.all_token_ids
        # Tokens sampled but not yet fed back have no KV yet; the bound keeps them out.
        known = min(computed, len(tokens))
        if known > plan.hashed_tokens:
            plan.keys += [k.hex() for k in plan.chain.extend(tokens[plan.hashed_tokens : known])]
            plan.hashed_tokens = known
        complete = known // self.block_tokens
        if complete <= plan.stored:
            return []
        block_ids = self.kv_cache_manager.get_block_ids(request_id)[0]
        stores = [StoreBlock(plan.keys[i], block_ids[i]) for i in range(plan.stored, complete)]
        plan.stored = complete
        return stores

    def build_meta(self, output: SchedulerOutput) -> KVSPConnectorMetadata:
        meta = KVSPConnectorMetadata(compat_id=self.compat_id, loads=self._loads)
        self._loads = []
        for request_id, computed in self._computed_after_step(output):
            plan = self._plans.get(request_id)
            if plan is not None:
                meta.stores += self._blocks_to_store(request_id, plan, computed)
        return meta

    def finished(self, request: Request) -> None:
        self._plans.pop(request.request_id, None)


# -- the worker side ----------------------------------------------------------------------------


@dataclass
class ConnectorCounts:
    """What the worker side did, for operators and tests (in blocks)."""

    loaded: int = 0
    load_failed: int = 0
    stored: int = 0
    already_held: int = 0
    store_failed: int = 0


class _WorkerSide:
    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig):
        self.settings = settings
        self.geometry = EngineGeometry.of(vllm_config)
        self.vllm_config = vllm_config
        self.client = KvspClient(settings.control_url, settings.token)
        self.caches: list[torch.Tensor] = []
        self.layout: PagedLayout | None = None
        self.counts = ConnectorCounts()
        self._lock = threading.Lock()
        self._loading: dict[str, Future] = {}
        self._failed_blocks: set[int] = set()
        self._load_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvsp-load")
        self._fetch_pool = ThreadPoolExecutor(
            max_workers=FETCHES_AT_ONCE, thread_name_prefix="kvsp-fetch"
        )
        self._store_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-store")

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        caches = [tensor for _, tensor in ordered]
        if len(caches) != self.geometry.layers:
            raise ValueError(
                f"vLLM registered {len(caches)} KV caches for a model of "
                f"{self.geometry.layers} layers"
            )
        backend = "CPU_ATTN" if caches[0].device.type == "cpu" else "FLASH_ATTN"
        layout = layout_for(backend, self.geometry.block)
        for cache in caches:
            layout.check(cache)
        if backend == "CPU_ATTN":
            _check_cpu_isa(self.vllm_config, self.geometry)
        self.caches, self.layout = caches, layout

    # loading

    def start_loads(self, meta: KVSPConnectorMetadata) -> None:
        for spec in meta.loads:
            future = self._load_pool.submit(self._load, spec, meta.compat_id)
            with self._lock:
                self._loading[spec.request_id] = future

    def _load(self, spec: LoadSpec, compat_id: str) -> set[int]:
        """The ids of the blocks that did not load: the first failure and all after it.

        Blocks are fetched ``FETCHES_AT_ONCE`` at a time.
        """
        deadline = time.monotonic() + self.settings.load_timeout_s
        futures = [
            self._fetch_pool.submit(self._load_block, block, deadline) for block in spec.blocks
        ]
        for index, future in enumerate(futures):
            try:
                future.result()
            except Exception as error:  # noqa: BLE001 - any failure means recompute, never a stuck request
                for later in futures[index + 1 :]:
                    later.cancel()
                failed = {later.block_id for later in spec.blocks[index:]}
                log.warning(
                    "KVSP: %d of %d blocks of request %s did not load and are recomputed: %s",
                    len(failed),
                    len(spec.blocks),
                    spec.request_id,
                    error,
                )
                # Fetches already running finish (or fail) before vLLM may reuse the blocks.
                for later in futures[index + 1 :]:
                    if not later.cancelled():
                        with contextlib.suppress(Exception):
                            later.result()
                with self._lock:
                    self.counts.loaded += index
                    self.counts.load_failed += len(failed)
                return failed
        with self._lock:
            self.counts.loaded += len(spec.blocks)
        return set()

    def _load_block(self, block: LoadBlock, deadline: float) -> None:
        records = [ReplicaRecord.from_json(obj) for obj in block.replicas]
        # The local node first: its copy is the cheapest to read.
        records.sort(key=lambda record: record.holder != self.settings.holder_url)
        errors = []
        for record in records:
            if len(record.layer_digests) != self.geometry.layers:
                errors.append(f"{record.holder} lists {len(record.layer_digests)} layers")
                continue
            try:
                self.client.fetch_block(
                    record,
                    max_size=self.geometry.container_size,
                    deadline=deadline,
                    on_layer=lambda layer: self._install(layer, block.block_id),
                )
                return
            except PeerError as error:
                errors.append(str(error))
        raise PeerError("; ".join(errors) or "no replica")

    def _install(self, layer: Layer, block_id: int) -> None:
        g = self.geometry.block
        k, v = (
            tensor_from_section(
                section, self.geometry.kv_dtype, g.kv_heads, g.head_dim, token_count=g.block_tokens
            )
            for section in (layer.k, layer.v)
        )
        self.layout.write(self.caches[layer.index], block_id, k, v)

    def finished_loads(self) -> set[str]:
        done = set()
        with self._lock:
            for request_id, future in list(self._loading.items()):
                if future.done():
                    self._failed_blocks |= future.result()
                    done.add(request_id)
                    del self._loading[request_id]
        return done

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # storing

    def store(self, meta: KVSPConnectorMetadata) -> None:
        for block in meta.stores:
            # Read now, while the block still holds this request's tokens; encode and send
            # on the store thread.
            layers = [self.layout.read(cache, block.block_id) for cache in self.caches]
            self._store_pool.submit(self._store, meta.compat_id, block.block_key, layers)

    def _store(self, compat_id: str, block_key: str, layers: list) -> None:
        try:
            stored = self.client.store_block(
                self.settings.holder_url,
                compat_id,
                self.settings.scope_id,
                block_key,
                encode_tensors(layers),
            )
        except Exception as error:  # noqa: BLE001 - a block not stored is a later miss, no more
            log.warning("KVSP: block %s not stored: %s", block_key, error)
            with self._lock:
                self.counts.store_failed += 1
            return
        with self._lock:
            if stored:
                self.counts.stored += 1
            else:
                self.counts.already_held += 1

    def drain(self) -> None:
        """Wait for the stores submitted so far."""
        self._store_pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        self._fetch_pool.shutdown(wait=True)
        self.client.close()


def _check_cpu_isa(vllm_config: VllmConfig, geometry: EngineGeometry) -> None:
    """The CPU layout handled is the one of the "vec" instruction set; AMX (bfloat16 on CPUs
    that have it) packs its pages otherwise, and loading into it would give wrong tokens."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(
        vllm_config.model_config.dtype,
        geometry.block.block_tokens,
        geometry.block.head_dim,
        vllm_config.cache_config.cache_dtype,
    )
    if isa != "vec":
        raise ValueError(f"the KVSP connector handles the CPU cache of ISA 'vec', not {isa!r}")


# -- the connector vLLM loads -------------------------------------------------------------------


class KVSPConnector(KVConnectorBase_V1):
    """The KV connector for ``--kv-transfer-config`` (DESIGN.md section 9)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(settings, vllm_config)
        else:
            self._worker = _WorkerSide(settings, vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a store that never happens is a later miss, nothing a request waits for.
        return False

    @property
    def counts(self) -> ConnectorCounts:
        """The worker side's counts (a worker-side connector only)."""
        return self._worker.counts

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request waits for its blocks outside the forward pass.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Blocks are read once all layers of the step are computed, in wait_for_save.
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.store(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def drain_stores(self) -> None:
        """Wait until the blocks submitted for storing so far are stored (or refused)."""
        self._worker.drain()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request)
        return False, None
