"""The nodes' rows are visible, read-only, in the control plane's admin."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tests.node.support import block_row
from workers.models import Directive, MeasuredLink, Node, ServedSession

pytestmark = pytest.mark.django_db

MODELS = (
    "node",
    "storedblock",
    "lease",
    "directive",
    "pendingwithdrawal",
    "measuredlink",
    "servedsession",
    "reshardmove",
)


def test_admin_lists_node_rows_and_offers_no_changes():
    now = timezone.now()
    Node.objects.create(name="ii1", epoch=1)
    block_row(
        "ii1",
        (b"\x01" * 32, b"\x02" * 16, b"\x03" * 32),
        now,
        layer_count=1,
        layer_digests=b"\x05" * 32,
    ).save()
    Directive.objects.create(
        instance="ii1",
        directive="6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
        compat_id=b"\x01" * 32,
        scope_id=b"\x02" * 16,
        body={},
        received_at=now,
        deadline_at=now,
    )
    MeasuredLink.objects.create(
        instance="ii1", holder="http://h/kvsp/", mbit_per_s=1.0, rtt_us=1.0, measured_at=now
    )
    ServedSession.objects.create(
        instance="ii1",
        session="6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
        epoch=1,
        kind="generate",
        scope_id=b"\x02" * 16,
        compat_id=b"\x01" * 32,
        body={},
        received_at=now,
    )
    client = Client()
    client.force_login(User.objects.create_superuser("op", "op@example.test", "pw"))
    for model in MODELS:
        page = client.get(reverse(f"admin:workers_{model}_changelist"))
        assert page.status_code == 200, model
        assert client.get(reverse(f"admin:workers_{model}_add")).status_code == 403
    assert b"ii1" in client.get(reverse("admin:workers_storedblock_changelist")).content
