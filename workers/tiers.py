"""The tier store of a node (DESIGN.md section 1): where a held block's octets are, and what an
engine reads from them.

The hierarchy is inclusive. Every held block has one serving copy, a file holding its KV Block
Container (4.3) exactly as it is sent:

- host tier: a file in shared memory (``KVSP_SHM_DIR/<instance>/``, tmpfs under ``/dev/shm``);
- disk tier: a file under ``KVSP_DISK_DIR/<instance>/``.

The node's HTTP process serves both from the file, a piece at a time. The device tier lives in
the worker process, which owns tensors: it keeps working copies of the leading layers of some
blocks as torch tensors (CUDA when present, else the CPU), for an engine: one copy of those
layers' octets each, in one transfer, and a layer's K and V as views into it.
A Replica Record reports each layer in the fastest tier that holds it — "device" for the layers
with a working copy, the serving tier for the rest — and gives every entry the
``read_mbit_per_s`` of the serving tier, since that is where a peer's GET reads them from.

What an engine gets (:class:`TierStore`): a block's container as views into its mapped file
(:meth:`TierStore.open`), and the K and V tensors of one layer (:meth:`TierStore.layer_kv`):
the device tier's tensors when it holds that layer, otherwise tensors over the mapped file,
shared without a copy on little-endian hosts (``kvsp.tensors.tensor_from_section``).
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from kvsp.container import Container, decode
from kvsp.problems import ProtocolError
from kvsp.records import DEFAULT_LIMITS
from kvsp.tensors import (
    check_geometry,
    octets_to_device,
    tensor_from_octets,
    tensor_from_section,
)

if TYPE_CHECKING:
    import torch

    from workers.models import StoredBlock

BlockIds = tuple[bytes, bytes, bytes]  # (compat_id, scope_id, block_key)

HOST = "host"
DISK = "disk"
DEVICE = "device"
SPOOL_PREFIX = ".incoming-"


def tier_dir(tier: str, instance: str) -> Path:
    base = settings.KVSP_SHM_DIR if tier == HOST else settings.KVSP_DISK_DIR
    return Path(base) / instance


def ensure_dirs(instance: str) -> None:
    for tier in (HOST, DISK):
        tier_dir(tier, instance).mkdir(parents=True, exist_ok=True, mode=0o700)


def file_name(ids: BlockIds) -> str:
    compat_id, scope_id, block_key = ids
    return f"{compat_id.hex()}.{scope_id.hex()}.{block_key.hex()}.kvb"


def block_path(tier: str, instance: str, ids: BlockIds) -> Path:
    return tier_dir(tier, instance) / file_name(ids)


def stored_path(block: StoredBlock) -> Path:
    return block_path(block.tier, block.instance, block.ids)


def read_mbit_per_s(tier: str) -> int:
    if tier == HOST:
        return settings.KVSP_TIER_HOST_READ_MBIT_PER_S
    return settings.KVSP_TIER_DISK_READ_MBIT_PER_S


def capacity(tier: str) -> int:
    return {
        HOST: settings.KVSP_TIER_HOST_OCTETS,
        DISK: settings.KVSP_TIER_DISK_OCTETS,
        DEVICE: settings.KVSP_TIER_DEVICE_OCTETS,
    }[tier]


def new_spool(instance: str):
    """A new, empty file in the host tier to receive a block into; renamed into place when the
    block is admitted, so that a received block is written once."""
    ensure_dirs(instance)
    return tempfile.NamedTemporaryFile(
        prefix=SPOOL_PREFIX, dir=tier_dir(HOST, instance), delete=False
    )


def write_spool(instance: str, parts: Iterable) -> Path:
    """A spool file in the host tier holding ``parts`` (buffers) concatenated. Named by this
    process and a counter, and written with plain system calls: a loader writes one a block,
    and a temporary file object (a random name, a wrapper, a buffered writer) and making sure
    of the tier's directories each time cost more than the write of a small block."""
    directory = tier_dir(HOST, instance)
    while True:
        path = directory / f"{SPOOL_PREFIX}{os.getpid()}-{next(_spool_numbers)}"
        try:
            fd = os.open(path, _SPOOL_FLAGS, 0o600)
            break
        except FileNotFoundError:
            ensure_dirs(instance)
        except FileExistsError:
            continue  # left by an earlier process of the same id: take the next number
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)
    return path


_spool_numbers = itertools.count()
_SPOOL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def place_file(source: Path, target: Path) -> None:
    """Move a file into place: a rename within one file system, else a copy (``sendfile`` in
    the kernel) to a temporary name and a rename, so that ``target`` is never partial."""
    try:
        os.replace(source, target)
        return
    except OSError as exc:
        if exc.errno != 18:  # EXDEV: another file system
            raise
    partial = target.with_name(SPOOL_PREFIX + target.name)
    shutil.copyfile(source, partial)
    os.replace(partial, target)
    source.unlink()


def copy_file(source: Path, target: Path) -> None:
    """Copy a serving copy to another tier, leaving the source for readers until the copy is
    committed."""
    partial = target.with_name(SPOOL_PREFIX + target.name)
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def unlink_quietly(path: Path) -> None:
    with suppress(FileNotFoundError):
        path.unlink()


def orphan_files(instance: str, known: set[Path]) -> list[Path]:
    """Files in the node's tier directories that are no stored block's serving copy (left by
    a crash between two steps of a placement or a move)."""
    orphans = []
    for tier in (HOST, DISK):
        directory = tier_dir(tier, instance)
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            if entry.is_file() and entry not in known:
                orphans.append(entry)
    return orphans


class MappedContainer:
    """A stored container mapped copy-on-write, decoded as views into the mapping: reading
    shares the file's pages, and a tensor written to by mistake changes a private copy of the
    page, never the serving copy."""

    def __init__(self, path: Path, *, max_layers: int | None = None):
        with path.open("rb") as handle:
            self._mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self.container: Container = decode(
                self._mapping, max_layers=max_layers or DEFAULT_LIMITS.max_layers
            )
        except BaseException:
            with suppress(BufferError):
                self._mapping.close()
            raise

    def close(self) -> None:
        self.container = None
        # Views handed out (tensors over sections) keep the mapping alive until they go; the
        # mapping is then unmapped when it is collected.
        with suppress(BufferError):
            self._mapping.close()

    def __enter__(self) -> MappedContainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Geometry:
    """What turns a codec raw section into a tensor (4.1): from the Compatibility Descriptor."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    block_tokens: int

    @classmethod
    def from_descriptor(cls, descriptor: dict) -> Geometry:
        return cls(
            layers=descriptor["layers"],
            kv_heads=descriptor["kv_heads"],
            head_dim=descriptor["head_dim"],
            kv_dtype=descriptor["kv_dtype"],
            block_tokens=descriptor["block_tokens"],
        )

    def check(self, container: Container) -> None:
        """A stored block holds every layer of the model for exactly one block of tokens."""
        if container.first_layer != 0 or container.layer_count != self.layers:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"the container holds layers {container.first_layer}-{container.last_layer}; "
                f"a block of this model has layers 0-{self.layers - 1}",
            )
        if container.token_count != self.block_tokens:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"the container holds {container.token_count} tokens; a block of this model "
                f"holds {self.block_tokens}",
            )
        check_geometry(container, self.kv_dtype, self.kv_heads, self.head_dim)


@dataclass
class _DeviceEntry:
    """A block's working copy: the sections of its leading layers as they lie in its container,
    one copy of their octets on the device (``octets``, a flat uint8 tensor), and where each
    layer's K and V start in it and how long they are. A layer's tensors are views into it,
    made when an engine asks for them."""

    octets: torch.Tensor | None
    sections: list[tuple[int, int, int, int]]
    geometry: Geometry | None
    size: int

    @property
    def layer_count(self) -> int:
        return len(self.sections)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_start, k_length, v_start, v_length = self.sections[layer]
        geometry = self.geometry
        return tuple(
            tensor_from_octets(
                self.octets[start : start + length],
                geometry.kv_dtype,
                geometry.kv_heads,
                geometry.head_dim,
            )
            for start, length in ((k_start, k_length), (v_start, v_length))
        )


@dataclass(frozen=True)
class DeviceAdmission:
    """What admitting a block to the device tier did: its leading layers now held there, and
    the blocks whose working copies were dropped to make room."""

    layers: int
    octets: int
    dropped: tuple[BlockIds, ...]


class DeviceTier:
    """Working copies of leading layers as tensors, in the worker process; least recently used
    copies are dropped first. Dropping a working copy leaves the replica held (the hierarchy is
    inclusive), so it needs no lease check and no withdrawal, only a fresh record."""

    def __init__(self, capacity_octets: int, device: str | None = None):
        self.capacity = capacity_octets
        self._device_name = device
        self._entries: OrderedDict[BlockIds, _DeviceEntry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        import torch

        if self._device_name is None:
            self._device_name = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(self._device_name)

    @property
    def used(self) -> int:
        with self._lock:
            return sum(entry.size for entry in self._entries.values())

    def held(self) -> dict[BlockIds, int]:
        """Blocks with a working copy, and how many leading layers it has."""
        with self._lock:
            return {ids: entry.layer_count for ids, entry in self._entries.items()}

    def prepare(self, container: Container, geometry: Geometry) -> _DeviceEntry:
        """A working copy of as many leading layers of ``container`` as the tier can hold at
        all, made before the block is admitted, so that the copying holds up nobody: their
        octets lie together in the container (layers ascending, K before V), so they go to the
        device in one copy whatever their number."""
        sizes = [sum(container.section_lengths(layer)) for layer in range(container.layer_count)]
        count, size = 0, 0
        while count < len(sizes) and size + sizes[count] <= self.capacity:
            size += sizes[count]
            count += 1
        if not count:
            return _DeviceEntry(None, [], None, 0)
        start, end = container.data_range(container.first_layer, container.first_layer + count - 1)
        octets = octets_to_device(container.buffer[start:end], self.device)
        sections, offset = [], 0
        for layer in range(count):
            k_length, v_length = container.section_lengths(container.first_layer + layer)
            sections.append((offset, k_length, offset + k_length, v_length))
            offset += k_length + v_length
        return _DeviceEntry(octets, sections, geometry, size)

    def install(self, ids: BlockIds, prepared: _DeviceEntry) -> DeviceAdmission:
        """Hold prepared copies, dropping the least recently used copies of other blocks to
        make room."""
        if not prepared.layer_count:
            return DeviceAdmission(0, 0, ())
        dropped = []
        with self._lock:
            self._entries.pop(ids, None)
            free = self.capacity - sum(entry.size for entry in self._entries.values())
            while free < prepared.size and self._entries:
                victim, entry = self._entries.popitem(last=False)
                free += entry.size
                dropped.append(victim)
            self._entries[ids] = prepared
        return DeviceAdmission(prepared.layer_count, prepared.size, tuple(dropped))

    def layer(self, ids: BlockIds, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            entry = self._entries.get(ids)
            if entry is None or layer >= entry.layer_count:
                return None
            self._entries.move_to_end(ids)
        return entry.layer(layer)

    def drop(self, ids: BlockIds) -> bool:
        with self._lock:
            return self._entries.pop(ids, None) is not None

    def keep_only(self, stored: set[BlockIds]) -> list[BlockIds]:
        """Drop the working copies of blocks no longer held (evicted by another process)."""
        with self._lock:
            gone = [ids for ids in self._entries if ids not in stored]
            for ids in gone:
                del self._entries[ids]
        return gone

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class TierStore:
    """An engine's view of the node's blocks (see the module docstring)."""

    def __init__(self, instance: str, device_tier: DeviceTier | None):
        self.instance = instance
        self.device_tier = device_tier

    def block(self, compat_id: bytes, scope_id: bytes, block_key: bytes) -> StoredBlock | None:
        from workers.models import StoredBlock

        return StoredBlock.objects.filter(
            instance=self.instance,
            compat_id=compat_id,
            scope_id=scope_id,
            block_key=block_key,
            pending_move__isnull=True,
        ).first()

    @contextmanager
    def open(self, block: StoredBlock):
        """The block's container, as views into its mapped serving copy."""
        with MappedContainer(stored_path(block), max_layers=block.layer_count) as mapped:
            yield mapped.container

    def layer_kv(
        self,
        block: StoredBlock,
        layer: int,
        geometry: Geometry,
        device: str | torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of a held block, shaped [tokens, kv_heads, head_dim].

        From the device tier when it holds the layer (moved to ``device`` if another is asked
        for); otherwise tensors over the mapped serving copy, which share its memory on the CPU
        and must be treated as read-only.
        """
        with HeldLayers(self, geometry, device) as held:
            return held.layer(block, layer)

    @staticmethod
    def _mapped_layer(mapped: MappedContainer, block, layer: int, geometry: Geometry, device):
        return tuple(
            tensor_from_section(
                section,
                geometry.kv_dtype,
                geometry.kv_heads,
                geometry.head_dim,
                device,
                token_count=block.token_count,
            )
            for section in mapped.container.layer(layer)
        )

    def _open_current(self, block: StoredBlock) -> MappedContainer:
        """The block's serving copy, mapped; read from the row again once when the file has
        moved to another tier since ``block`` was read."""
        try:
            return MappedContainer(stored_path(block), max_layers=block.layer_count)
        except FileNotFoundError:
            from workers.models import StoredBlock

            fresh = StoredBlock.objects.filter(pk=block.pk).first()
            if fresh is None or fresh.tier == block.tier:
                raise
            return MappedContainer(stored_path(fresh), max_layers=fresh.layer_count)

    def layers_in_order(
        self,
        blocks: list[StoredBlock],
        geometry: Geometry,
        device: str | torch.device | None = None,
    ):
        """(layer, index, K, V) for every layer of every block in ``blocks``, layer 0 of all
        blocks first, then layer 1, and so on: the order in which a forward pass over the
        tokens after them needs them (4.3). Device-tier copies are used where they exist;
        each serving copy is mapped once."""
        with HeldLayers(self, geometry, device) as held:
            for layer in range(geometry.layers):
                for index, block in enumerate(blocks):
                    k, v = held.layer(block, layer)
                    yield layer, index, k, v


class HeldLayers:
    """K and V of the layers of held blocks, for an import that takes them in any order: from
    the device tier where it holds the layer, otherwise as views into the block's serving copy,
    mapped once and kept mapped until ``close`` (the views stay valid after it)."""

    def __init__(
        self, store: TierStore, geometry: Geometry, device: str | torch.device | None = None
    ):
        self.store = store
        self.geometry = geometry
        self.device = device
        self._mapped: dict[int, MappedContainer] = {}

    def layer(self, block: StoredBlock, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        device_tier = self.store.device_tier
        held = device_tier.layer(block.ids, layer) if device_tier is not None else None
        if held is not None:
            if self.device is None:
                return held
            return held[0].to(self.device), held[1].to(self.device)
        mapped = self._mapped.get(block.pk)
        if mapped is None:
            mapped = self._mapped[block.pk] = self.store._open_current(block)
        return self.store._mapped_layer(mapped, block, layer, self.geometry, self.device)

    def close(self) -> None:
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

    def __enter__(self) -> HeldLayers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
