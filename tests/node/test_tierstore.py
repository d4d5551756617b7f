"""What an engine reads from the tier store: a held block's container mapped from its serving
copy, and one layer's K and V as tensors, from the device tier when it holds the layer."""

from __future__ import annotations

import pytest
import torch
from django.test import override_settings
from django.utils import timezone

from kvsp.container import decode
from kvsp.tensors import tensor_from_section
from tests.node.support import container
from workers import tiers
from workers.models import StoredBlock

pytestmark = pytest.mark.django_db

GEOMETRY = tiers.Geometry(layers=4, kv_heads=2, head_dim=16, kv_dtype="float32", block_tokens=16)
IDS = (b"\x01" * 32, b"\x02" * 16, b"\x03" * 32)


@pytest.fixture
def held(tmp_path):
    data = container(900)
    with override_settings(KVSP_SHM_DIR=tmp_path / "shm", KVSP_DISK_DIR=tmp_path / "disk"):
        tiers.ensure_dirs("ii1")
        tiers.block_path(tiers.HOST, "ii1", IDS).write_bytes(data)
        now = timezone.now()
        block = StoredBlock.objects.create(
            instance="ii1",
            compat_id=IDS[0],
            scope_id=IDS[1],
            block_key=IDS[2],
            codec=1,
            size=len(data),
            token_count=16,
            layer_count=4,
            digest=b"\x00" * 32,
            layer_digests=b"".join(decode(data).layer_digests()),
            repr_sha256=b"\x00" * 32,
            tier=tiers.HOST,
            stored_at=now,
            last_access=now,
            refresh_due_at=now,
        )
        yield block, decode(bytearray(data))


def same(a, b) -> bool:
    """Equal octets (random sections hold NaNs, which torch.equal never finds equal)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def expected(whole, layer):
    return [
        tensor_from_section(section, "float32", 2, 16, token_count=16)
        for section in whole.layer(layer)
    ]


def test_layers_come_from_the_mapped_serving_copy(held):
    block, whole = held
    store = tiers.TierStore("ii1", None)
    assert store.block(*IDS).pk == block.pk
    with store.open(block) as mapped:
        assert mapped.layer_digests() == whole.layer_digests()
    k, v = store.layer_kv(block, 2, GEOMETRY)
    want_k, want_v = expected(whole, 2)
    assert k.shape == (16, 2, 16) and k.dtype == torch.float32
    assert same(k, want_k) and same(v, want_v)
    # The tensors share the file's pages copy-on-write: writing to one leaves the file intact.
    path = tiers.stored_path(block)
    before = path.read_bytes()
    k.view(torch.int32).fill_(7)
    assert path.read_bytes() == before


def test_the_device_tier_answers_for_the_layers_it_holds(held):
    block, whole = held
    device = tiers.DeviceTier(2 * 2 * 2048, device="cpu")  # two layers of K and V
    admission = device.install(IDS, device.prepare(whole, GEOMETRY))
    assert (admission.layers, admission.octets, admission.dropped) == (2, 8192, ())
    store = tiers.TierStore("ii1", device)
    held_k, _ = device.layer(IDS, 1)
    k, v = store.layer_kv(block, 1, GEOMETRY)
    # The device tier's own copy (its memory), not tensors over the file.
    assert k.data_ptr() == held_k.data_ptr() and same(k, expected(whole, 1)[0])
    assert same(v, expected(whole, 1)[1])
    k3, _ = store.layer_kv(block, 3, GEOMETRY)  # not on the device: from the file
    assert same(k3, expected(whole, 3)[0])

    other = (b"\x09" * 32, IDS[1], IDS[2])
    second = device.install(other, device.prepare(whole, GEOMETRY))
    assert second.dropped == (IDS,) and device.layer(IDS, 0) is None
    assert device.keep_only(set()) == [other] and device.held() == {}
