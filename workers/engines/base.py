"""The inference engine adapter: what a node's worker asks of a model (DESIGN.md section 8).

An adapter runs one model under one Compatibility Descriptor (spec 4.1) and keeps, per request,
a :class:`Sequence`: the positions processed so far, their KV cache and the logits of the last
one. Besides prefill and decode, it moves the cache in and out as KV Block Containers (4.3):

- ``export_blocks`` encodes block i, the tokens [i*B, (i+1)*B), with all layers, codec raw,
  layout kvsp-layout-1: per layer, K and V shaped [tokens, kv_heads, head_dim]. A holder
  publishes these (6.1) and serves them (6.7).
- ``import_blocks`` builds a cache from containers of blocks 0..n-1, after a prefetch (6.5) or
  on resume (6.8); ``extend`` then processes what the blocks do not cover: a prompt tail, or
  generated tokens after the last complete block.
- ``begin_import`` does the same layer by layer. Containers carry their layers in ascending
  order "so that a receiver can start using layer l as soon as it has been received" (4.3); a
  forward pass over new tokens runs layer l as soon as layer l of every block has arrived and
  waits only for the layers still in flight.

Blocks are prefix-keyed (4.2), so the positions of block i are always [i*B, (i+1)*B): a block
imported from another instance holds keys rotated for exactly the positions it occupies here.

Threads: an engine serves many sequences from many threads; a sequence is used by one thread at
a time, while its :class:`LayerwiseImport` is fed from any number of others.
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from kvsp.compat import compat_id_hex
from kvsp.container import (
    Buffer,
    Container,
    ContainerStreamReader,
    EncodedContainer,
    Layer,
    decode,
    verify_replica_digest,
)
from kvsp.problems import ProtocolError
from kvsp.registries import RAW_CODEC
from kvsp.tensors import (
    check_geometry,
    encode_tensors,
    layer_tensors,
    tensor_from_section,
    torch_dtype,
)

BlockSource = Container | EncodedContainer | Buffer


def _invalid_container(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-invalid-container", detail)


def _malformed(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-malformed-request", detail)


class Sequence:
    """One request's state in an engine.

    ``length`` counts the processed positions. ``tokens`` lists their token ids, or is None when
    the cache began with imported blocks whose tokens were not given: a resumed session knows
    its prompt blocks by their keys alone (6.8). ``cache`` holds one entry per layer in the
    engine's own layout (None: not yet arrived, or nothing processed). ``pending`` is the
    layer-wise import still filling the cache, if any. ``logits`` are those of the last
    processed position, and ``layer_started`` the monotonic times at which the latest forward
    pass began each layer.
    """

    __slots__ = (
        "block_tokens",
        "cache",
        "compat_id",
        "layer_started",
        "length",
        "logits",
        "pending",
        "tokens",
    )

    def __init__(
        self,
        *,
        compat_id: str,
        block_tokens: int,
        layers: int,
        tokens: list[int] | None,
        length: int,
    ):
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.tokens = tokens
        self.length = length
        self.cache: list[Any] = [None] * layers
        self.pending: LayerwiseImport | None = None
        self.logits: torch.Tensor | None = None
        self.layer_started: list[float] = []

    @property
    def complete_blocks(self) -> int:
        """How many complete blocks the processed positions make (4.2: only these have keys)."""
        return self.length // self.block_tokens

    def __repr__(self) -> str:
        pending = " importing" if self.pending is not None else ""
        return f"<Sequence length={self.length} compat={self.compat_id[:12]}{pending}>"


class LayerwiseImport:
    """Blocks 0..n-1 of a cache, arriving layer by layer and used while they arrive (4.3).

    Producers hand in the K and V of one layer of one block at a time, in any order and from
    any thread: :meth:`add_layer` for tensors or sections, :meth:`add_container` for a decoded
    container (or a layer range of one, 6.7), :meth:`add_received` for the layers a
    :class:`~kvsp.container.ContainerStreamReader` completes. Layer l is ready once every
    block's layer l has arrived; the producer that completes it joins the blocks into one
    tensor of n*B tokens and passes it to ``prepare`` (the engine's conversion to its own
    layout), so the forward pass pays for neither. The forward pass calls :meth:`take_layer`
    before running a layer.

    A rejected layer (wrong geometry, a block outside 0..n-1, a layer that arrived twice) raises
    ProtocolError and leaves the import open, so the caller can fetch that block from another
    source; :meth:`fail` ends the import, and a waiting forward pass raises the error given.

    What happened when is kept in monotonic times: ``ready_at[l]`` when layer l became ready,
    ``requested_at[l]`` when a forward pass asked for it (it may then have waited).
    """

    def __init__(
        self,
        *,
        block_count: int,
        block_tokens: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        prepare: Callable[[torch.Tensor, torch.Tensor], Any],
        timeout: float | None = None,
    ):
        if block_count < 1:
            raise ValueError("an import holds at least one block")
        self.block_count = block_count
        self.block_tokens = block_tokens
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.timeout = timeout
        self.sequence: Sequence | None = None
        self.ready_at: list[float | None] = [None] * layers
        self.requested_at: list[float | None] = [None] * layers
        self._dtype = torch_dtype(kv_dtype)
        self._prepare = prepare
        self._condition = threading.Condition()
        self._parts: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [
            [None] * block_count for _ in range(layers)
        ]
        self._missing = [block_count] * layers
        self._ready: list[Any] = [None] * layers
        self._taken = [False] * layers
        self._error: BaseException | None = None

    @property
    def token_count(self) -> int:
        return self.block_count * self.block_tokens

    @property
    def done(self) -> bool:
        """Whether every layer of every block has arrived."""
        with self._condition:
            return not any(self._missing)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _tensor(self, section: torch.Tensor | Buffer, what: str) -> torch.Tensor:
        shape = (self.block_tokens, self.kv_heads, self.head_dim)
        if isinstance(section, torch.Tensor):
            if section.dtype != self._dtype or tuple(section.shape) != shape:
                raise _invalid_container(
                    f"{what} is {list(section.shape)} {section.dtype}; a block of this model is "
                    f"{list(shape)} {self._dtype}"
                )
            return section
        return tensor_from_section(
            section,
            self.kv_dtype,
            self.kv_heads,
            self.head_dim,
            token_count=self.block_tokens,
        )

    def add_layer(
        self, block: int, layer: int, k: torch.Tensor | Buffer, v: torch.Tensor | Buffer
    ) -> None:
        """Layer ``layer`` of block ``block``: K and V as tensors [B, kv_heads, head_dim] of
        the descriptor's kv_dtype, or as codec raw sections."""
        if not 0 <= block < self.block_count:
            raise _malformed(
                f"block {block} is not one of the blocks 0-{self.block_count - 1} of this import"
            )
        if not 0 <= layer < self.layers:
            raise _invalid_container(
                f"layer {layer} is not a layer of this model (0-{self.layers - 1})"
            )
        pair = (self._tensor(k, f"K of layer {layer}"), self._tensor(v, f"V of layer {layer}"))
        with self._condition:
            if self._error is not None:
                raise self._error
            if not self._missing[layer] or self._parts[layer][block] is not None:
                raise _malformed(f"layer {layer} of block {block} arrived twice")
            self._parts[layer][block] = pair
            self._missing[layer] -= 1
            if self._missing[layer]:
                return
            parts = self._parts[layer]
            self._parts[layer] = []
        # Only this thread completed the layer, so the join runs outside the lock and other
        # layers keep arriving meanwhile.
        try:
            k_all = torch.cat([part[0] for part in parts])
            v_all = torch.cat([part[1] for part in parts])
            prepared = self._prepare(k_all, v_all)
        except BaseException as error:
            self.fail(error)
            raise
        with self._condition:
            self._ready[layer] = prepared
            self.ready_at[layer] = time.monotonic()
            self._condition.notify_all()

    def add_container(self, block: int, container: Container) -> None:
        """Every layer of a decoded container of block ``block``; the geometry is checked
        before any layer is taken."""
        self._check_header(block, container.codec, container.token_count)
        if container.last_layer >= self.layers:
            raise _invalid_container(
                f"the container of block {block} holds layers {container.first_layer}-"
                f"{container.last_layer}; this model has {self.layers}"
            )
        check_geometry(container, self.kv_dtype, self.kv_heads, self.head_dim)
        for layer in range(container.first_layer, container.last_layer + 1):
            k, v = layer_tensors(container, layer, self.kv_dtype, self.kv_heads, self.head_dim)
            self.add_layer(block, layer, k, v)

    def add_received(
        self, block: int, reader: ContainerStreamReader, layers: Iterable[Layer]
    ) -> None:
        """The layers a stream reader of block ``block`` completed (what ``feed`` or
        ``buffer_updated`` returned): ``imp.add_received(b, reader, reader.feed(chunk))``."""
        for layer in layers:
            self._check_header(block, reader.codec, reader.token_count)
            self.add_layer(block, layer.index, layer.k, layer.v)

    def _check_header(self, block: int, codec: int | None, token_count: int | None) -> None:
        if codec != RAW_CODEC:
            raise ProtocolError(
                "kvsp-unsupported-codec",
                f"the container of block {block} has codec {codec}, not raw ({RAW_CODEC})",
            )
        if token_count != self.block_tokens:
            raise _invalid_container(
                f"the container of block {block} holds {token_count} tokens; a block holds "
                f"{self.block_tokens}"
            )

    def fail(self, error: BaseException) -> None:
        """End the import: waiting and later calls raise ``error`` (the first one given)."""
        with self._condition:
            if self._error is None:
                self._error = error
            self._condition.notify_all()

    def take_layer(self, layer: int) -> Any:
        """Wait until layer ``layer`` is ready and hand it over, in the engine's layout.

        Each layer is handed over once; the import keeps no reference to it afterwards.
        Raises the import's error, or TimeoutError after ``timeout`` seconds.
        """
        with self._condition:
            if self._taken[layer]:
                raise RuntimeError(f"layer {layer} of this import was already taken")
            if self.requested_at[layer] is None:
                self.requested_at[layer] = time.monotonic()
                self._condition.notify_all()
            ready = self._condition.wait_for(
                lambda: self._error is not None or self._ready[layer] is not None,
                self.timeout,
            )
            if self._error is not None:
                raise self._error
            if not ready:
                raise TimeoutError(
                    f"layer {layer} of the imported blocks did not arrive within {self.timeout} s"
                )
            prepared, self._ready[layer] = self._ready[layer], None
            self._taken[layer] = True
            return prepared

    def wait_requested(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until a forward pass asks for layer ``layer``; False after ``timeout`` seconds
        or when the import has failed. Shows a producer how far the computation has come."""
        with self._condition:
            return (
                self._condition.wait_for(
                    lambda: self.requested_at[layer] is not None or self._error is not None, timeout
                )
                and self.requested_at[layer] is not None
            )


def _as_container(source: BlockSource, layers: int) -> Container:
    if isinstance(source, Container):
        return source
    if isinstance(source, EncodedContainer):
        # Writable octets: torch warns about tensors made over read-only buffers such as bytes.
        source = bytearray().join(source.parts)
    return decode(source, max_layers=layers)


WARM_UP_TEXT = "KV caches kept beyond a request are found again and loaded before it arrives. "


class EngineAdapter(ABC):
    """The interface a node's worker calls. Subclasses provide the model; this class provides
    the protocol side: geometry from the descriptor, containers in and out, layer-wise import.

    Subclasses implement ``descriptor``, ``eos_token_id``, ``tokenize``, ``detokenize``,
    ``extend``, ``block_tensors`` and ``_cache_layer``; a forward pass obtains layer l's cache
    from ``_layer_cache``, which waits for a layer-wise import, and is counted by calling
    ``_count_forward_pass`` once it has completed.
    """

    _forward_passes = 0
    _forward_passes_lock = threading.Lock()

    @property
    def forward_passes(self) -> int:
        """The forward passes this engine has completed (prefill, extend and decode alike)."""
        return self._forward_passes

    def _count_forward_pass(self) -> None:
        with self._forward_passes_lock:
            self._forward_passes += 1

    def warm_up(self) -> int:
        """Run once, on a short prompt, each step a session takes, so that the first session
        does not pay for what a first run costs (lazy imports, the allocator's first requests,
        kernels chosen and compiled for their shapes): a prefill from position 0, the export of
        its first block as a container, a layer-wise import of that container with a tail run
        after it (the masked attention of a prompt whose prefix was cached) and a decoding step.

        Everything stays in this call: no container leaves it and the sequences are dropped.
        Returns the forward passes it ran."""
        block = self.block_tokens
        tail = max(2, block // 4)
        tokens: list[int] = []
        while len(tokens) < block + tail:
            words = self.tokenize(WARM_UP_TEXT)
            if not words:
                raise ValueError("the warm-up text has no tokens")
            tokens += words
        tokens = tokens[: block + tail]
        before = self.forward_passes
        prefilled = self.prefill(tokens)
        exported = self.export_blocks(prefilled, 0, 1)
        resumed = self.import_blocks(exported, tokens=tokens[:block], compat_id=self.compat_id)
        logits = self.extend(resumed, tokens[block:])
        self.decode(resumed, int(logits.argmax()))
        return self.forward_passes - before

    # -- identity and geometry (spec 4.1) ---------------------------------------------------------

    @property
    @abstractmethod
    def descriptor(self) -> dict:
        """The validated Compatibility Descriptor of the caches this engine produces."""

    @functools.cached_property
    def compat_id(self) -> str:
        """The Compatibility ID (hex32), computed from the descriptor (4.1)."""
        return compat_id_hex(self.descriptor)

    @property
    def block_tokens(self) -> int:
        return self.descriptor["block_tokens"]

    @property
    def layers(self) -> int:
        return self.descriptor["layers"]

    @property
    def kv_heads(self) -> int:
        return self.descriptor["kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.descriptor["head_dim"]

    @property
    def kv_dtype(self) -> str:
        return self.descriptor["kv_dtype"]

    @property
    @abstractmethod
    def eos_token_id(self) -> int | None:
        """The token that ends generation, if the model has one."""

    # -- text ---------------------------------------------------------------------------------

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    @abstractmethod
    def detokenize(self, tokens: SequenceOf[int]) -> str:
        """The text of ``tokens``."""

    # -- computation ----------------------------------------------------------------------------

    def new_sequence(self, *, tokens: list[int] | None = None, length: int = 0) -> Sequence:
        """An empty sequence, or one of ``length`` positions whose cache is yet to be filled."""
        return Sequence(
            compat_id=self.compat_id,
            block_tokens=self.block_tokens,
            layers=self.layers,
            tokens=[] if tokens is None and length == 0 else tokens,
            length=length,
        )

    def prefill(self, tokens: SequenceOf[int]) -> Sequence:
        """A new sequence holding the KV cache of ``tokens`` and the logits of the last one."""
        sequence = self.new_sequence()
        self.extend(sequence, tokens)
        return sequence

    @abstractmethod
    def extend(self, sequence: Sequence, tokens: SequenceOf[int]) -> torch.Tensor:
        """Process ``tokens`` after the positions of ``sequence`` and return the logits of the
        last one (also kept as ``sequence.logits``).

        The new tokens take positions ``sequence.length`` onwards. If a layer-wise import is
        still filling the cache, layer l runs as soon as layer l has arrived. On an error the
        sequence is left as it was.
        """

    def decode(self, sequence: Sequence, token: int) -> torch.Tensor:
        """One decoding step: process ``token`` and return the logits that follow it."""
        return self.extend(sequence, [token])

    # -- containers out (spec 4.3) ----------------------------------------------------------------

    @abstractmethod
    def block_tensors(
        self, sequence: Sequence, block: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of every layer for the tokens of block ``block``, each a contiguous tensor
        [block_tokens, kv_heads, head_dim] of the descriptor's kv_dtype."""

    def export_blocks(
        self, sequence: Sequence, first_block: int, count: int, *, threads: int | None = None
    ) -> list[EncodedContainer]:
        """Containers of blocks first_block .. first_block+count-1, all layers, codec raw.

        Only complete blocks can be exported: a block's key covers exactly B tokens (4.2).
        """
        if first_block < 0 or count < 0:
            raise ValueError("first_block and count must not be negative")
        if first_block + count > sequence.complete_blocks:
            raise ValueError(
                f"blocks {first_block}-{first_block + count - 1} are not all complete: the "
                f"sequence has {sequence.length} tokens, {sequence.complete_blocks} blocks"
            )
        self._check_sequence(sequence)
        for layer in range(self.layers):
            self._layer_cache(sequence, layer)
        return [
            encode_tensors(self.block_tensors(sequence, block), threads=threads)
            for block in range(first_block, first_block + count)
        ]

    # -- containers in (spec 4.3, 6.5, 6.8) -------------------------------------------------------

    @abstractmethod
    def _cache_layer(self, k: torch.Tensor, v: torch.Tensor) -> Any:
        """One layer's cache entry, in this engine's layout, from K and V [tokens, kv_heads,
        head_dim] of the descriptor's kv_dtype (on the CPU or elsewhere)."""

    def begin_import(
        self,
        block_count: int,
        *,
        tokens: SequenceOf[int] | None = None,
        timeout: float | None = None,
    ) -> LayerwiseImport:
        """Start a layer-wise import of blocks 0..block_count-1; its ``sequence`` can be
        extended at once, each layer waiting for its blocks.

        ``tokens``, when known, are the tokens the blocks cover (block_count * B of them).
        """
        token_list = self._imported_tokens(block_count, tokens)
        layerwise = LayerwiseImport(
            block_count=block_count,
            block_tokens=self.block_tokens,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            kv_dtype=self.kv_dtype,
            prepare=self._cache_layer,
            timeout=timeout,
        )
        sequence = self.new_sequence(tokens=token_list, length=block_count * self.block_tokens)
        sequence.pending = layerwise
        layerwise.sequence = sequence
        return layerwise

    def import_blocks(
        self,
        containers: SequenceOf[BlockSource] | Mapping[int, BlockSource],
        *,
        tokens: SequenceOf[int] | None = None,
        digests: SequenceOf[str] | None = None,
        compat_id: str | None = None,
    ) -> Sequence:
        """A sequence whose cache is built from containers of consecutive blocks from block 0.

        ``containers`` lists blocks 0, 1, ... in order, or maps block indexes to containers
        (which must then be 0..n-1). Each is a decoded container, an encoded one, or its octets,
        and must hold every layer. ``digests``, when given, are the replica digests (4.3) to
        check each container against. ``compat_id`` is the Compatibility ID the blocks were
        stored under (the ``{compat}`` of their resource name, 6.7): a container holds no
        model identity of its own, so a cache of another model with the same geometry is told
        apart only by it (4.1: caches with different ids MUST NOT be substituted).

        ProtocolError when the compat id differs, a container does not fit the descriptor, a
        digest differs or the blocks are not consecutive.
        """
        if compat_id is not None and compat_id != self.compat_id:
            raise ProtocolError(
                "kvsp-compat-mismatch",
                f"the blocks were stored under compat {compat_id}; this engine computes "
                f"{self.compat_id}",
            )
        if isinstance(containers, Mapping):
            count = len(containers)
            # n keys that are not 0..n-1 leave one of 0..n-1 out.
            missing = next((index for index in range(count) if index not in containers), None)
            if missing is not None:
                raise _malformed(
                    f"imported blocks must be consecutive from block 0; block {missing} is missing"
                )
            sources = [containers[index] for index in range(count)]
        else:
            sources = list(containers)
        if not sources:
            raise ValueError("import_blocks needs at least one block")
        if digests is not None and len(digests) != len(sources):
            raise ValueError(f"{len(digests)} digests for {len(sources)} blocks")
        decoded = [_as_container(source, self.layers) for source in sources]
        for block, container in enumerate(decoded):
            if container.first_layer != 0 or container.layer_count != self.layers:
                raise _invalid_container(
                    f"the container of block {block} holds layers {container.first_layer}-"
                    f"{container.last_layer}; an import needs all {self.layers} layers"
                )
            if digests is not None:
                verify_replica_digest(container.layer_digests(), digests[block])
        layerwise = self.begin_import(len(decoded), tokens=tokens)
        for block, container in enumerate(decoded):
            layerwise.add_container(block, container)
        sequence = layerwise.sequence
        for layer in range(self.layers):
            self._layer_cache(sequence, layer)
        return sequence

    # -- helpers for subclasses -------------------------------------------------------------------

    def _imported_tokens(
        self, block_count: int, tokens: SequenceOf[int] | None
    ) -> list[int] | None:
        if tokens is None:
            return None
        token_list = [int(token) for token in tokens]
        if len(token_list) != block_count * self.block_tokens:
            raise _malformed(
                f"{len(token_list)} tokens given for {block_count} blocks of "
                f"{self.block_tokens} tokens"
            )
        return token_list

    def _check_sequence(self, sequence: Sequence) -> None:
        if sequence.compat_id != self.compat_id:
            raise ValueError(
                f"the sequence holds a cache of compat {sequence.compat_id}, this engine "
                f"computes {self.compat_id}"
            )

    def _layer_cache(self, sequence: Sequence, layer: int) -> Any:
        """Layer ``layer``'s cache entry, waiting for it if a layer-wise import is filling it
        (None for a sequence with no positions yet)."""
        entry = sequence.cache[layer]
        if entry is None and sequence.pending is not None:
            entry = sequence.pending.take_layer(layer)
            sequence.cache[layer] = entry
            if all(item is not None for item in sequence.cache):
                sequence.pending = None
        return entry
