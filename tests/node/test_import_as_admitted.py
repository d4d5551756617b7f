"""A generation whose placement sent a prefetch directive imports the directive's blocks as they
are admitted (``workers.generation.serve_prompt`` with the directive), rather than after the
directive has ended: it waits while a block is missing, takes each batch as the loader admits
it, and gives the logits of a full prefill. A directive that ends without some of its blocks
leaves the prompt served from the prefix that was admitted. A resume imports the blocks of the
directive it carries out itself the same way (``import_as_admitted`` with its loading thread)."""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from workers import admission, notices, tiers
from workers.engines.modeldir import create_reference_model
from workers.engines.reference import ReferenceEngine
from workers.generation import PrefixNotLoaded, import_as_admitted, serve_prompt
from workers.models import Directive, DirectiveState

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "ii1"
BLOCKS = 5
COMPAT = b"\x01" * 32
SCOPE = b"\x02" * 16
# serve_prompt takes the prompt's Block Keys as given: any distinct keys stand for them here.
KEYS = [bytes([index + 1]) * 32 for index in range(BLOCKS)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return ReferenceEngine(create_reference_model(tmp_path_factory.mktemp("model")))


@pytest.fixture
def prompt(engine):
    tokens = [(7 * index) % 250 + 3 for index in range(BLOCKS * engine.block_tokens + 5)]
    whole = engine.prefill(tokens)
    exported = engine.export_blocks(whole, 0, BLOCKS)
    return SimpleNamespace(tokens=tokens, logits=whole.logits, exported=exported)


@pytest.fixture
def node(tmp_path):
    with override_settings(
        KVSP_INSTANCE=NAME, KVSP_SHM_DIR=tmp_path / "shm", KVSP_DISK_DIR=tmp_path / "disk"
    ):
        tiers.ensure_dirs(NAME)
        yield SimpleNamespace(name=NAME, tier_store=tiers.TierStore(NAME, None))


def admit(prompt, engine, *indexes: int) -> None:
    """What the loader does with a batch: the blocks admitted in one transaction, then the
    waiters told."""
    blocks = [((COMPAT, SCOPE, KEYS[index]), prompt.exported[index]) for index in indexes]
    admission.do_store_exported(blocks, engine.block_tokens)
    notices.notify()


def pending_directive() -> Directive:
    now = timezone.now()
    return Directive.objects.create(
        instance=NAME,
        directive=uuid.uuid4(),
        request_ref="placement-1",
        compat_id=COMPAT,
        scope_id=SCOPE,
        body={"blocks": [{"block_key": key.hex(), "sources": ["http://h/kvsp/"]} for key in KEYS]},
        received_at=now,
        # Far beyond the test: an import that waited for the deadline would never end here.
        deadline_at=now + timedelta(seconds=600),
    )


@contextmanager
def serving(node, engine, prompt, directive, *, ending: str):
    """The prompt served on a thread of its own while the block yields (the thread and the
    list its answer goes to); the directive then ends as ``ending``, if it has not yet."""
    answers = []

    def serve() -> None:
        try:
            answers.append(
                serve_prompt(
                    node,
                    engine,
                    COMPAT,
                    SCOPE,
                    KEYS,
                    prompt.tokens,
                    recompute=False,
                    directive=directive,
                )
            )
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield thread, answers
    finally:
        end(directive, ending)
        thread.join(timeout=60)


def end(directive: Directive, state: str) -> None:
    Directive.objects.filter(pk=directive.pk, state=DirectiveState.PENDING).update(state=state)
    notices.notify()


def test_blocks_are_imported_batch_by_batch_as_the_directive_admits_them(node, engine, prompt):
    admit(prompt, engine, 0)  # held before the directive came
    directive = pending_directive()
    with serving(node, engine, prompt, directive, ending=DirectiveState.COMPLETE) as running:
        thread, answers = running
        thread.join(timeout=0.5)
        assert thread.is_alive() and not answers, "the prompt ran before its blocks were in"
        admit(prompt, engine, 1, 2)
        thread.join(timeout=0.5)
        assert thread.is_alive() and not answers
        # The last batch, with the directive still pending: the prompt needs no more.
        admit(prompt, engine, 3, 4)
        thread.join(timeout=60)
        assert not thread.is_alive()
    served = answers[0]
    assert served.loaded_blocks == BLOCKS
    assert served.recomputed_tokens == 5
    assert served.held == set(KEYS)
    assert torch.allclose(served.sequence.logits, prompt.logits, atol=1e-4)


def test_a_directive_that_ends_short_leaves_the_admitted_prefix_imported(node, engine, prompt):
    directive = pending_directive()
    with serving(node, engine, prompt, directive, ending=DirectiveState.FAILED) as running:
        thread, answers = running
        admit(prompt, engine, 0, 1)
        admit(prompt, engine, 3)  # past a gap: of no use to the prefix
        end(directive, DirectiveState.FAILED)
        thread.join(timeout=60)
        assert not thread.is_alive()
    served = answers[0]
    assert served.loaded_blocks == 2
    assert served.recomputed_tokens == len(prompt.tokens) - 2 * engine.block_tokens
    assert torch.allclose(served.sequence.logits, prompt.logits, atol=1e-4)


def test_an_import_stops_waiting_when_the_thread_loading_its_directive_ends(node, engine, prompt):
    """A resume carries its directive out on a thread of its own: should that thread end with
    the directive still pending (it failed), the import stops waiting for it at once, not at
    the deadline."""
    admit(prompt, engine, 0)
    directive = pending_directive()
    loading = threading.Thread(target=lambda: None)
    loading.start()
    loading.join()
    outcome = []

    def run() -> None:
        covered = BLOCKS * engine.block_tokens
        try:
            import_as_admitted(
                engine,
                node,
                COMPAT,
                SCOPE,
                KEYS,
                directive,
                prompt.tokens[:covered],
                prompt.tokens[covered:],
                loading=loading,
            )
        except PrefixNotLoaded as error:
            outcome.append(str(error))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the import waited for the deadline"
    assert outcome == [f"block {KEYS[1].hex()} was not loaded"]
