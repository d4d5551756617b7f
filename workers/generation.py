"""Serving a session on the instance's worker (spec 6.8), once ``workers.served_sessions``
admitted it.

The prompt. Its Block Keys (4.2) are computed with the scope key. The longest prefix of the
prompt's blocks the tier store holds is imported layer by layer from it (device-tier copies
where there are some, mapped serving copies otherwise) while the forward pass over the rest of
the prompt runs layer l as soon as layer l has arrived (4.3). A generation whose request
carries the request_ref of a placement waits for that placement's prefetch directive (6.5) to
arrive, and imports the blocks it loads as each batch is admitted: the forward pass starts as
the last one lands, and a directive that ends short leaves the prefix it loaded.
The last prompt token is always run, for the logits of the first output token. The blocks the
instance computed itself are exported from the engine's cache and stored in its own tier store
at once (a local write); they are published like any block the node holds (6.1) and copied to
the session holders (``KVSP_SESSION_HOLDERS``) off the token path, so the first output token
never waits for either. A checkpoint lists prompt blocks by key alone, so it names only blocks
that exist elsewhere: those that were held already, and the computed ones once every one of
them is published and at a session holder. Until then ``prompt_tail`` carries every prompt
token after the named blocks, and a resume recomputes them (6.8 step 2): a session is always
resumable, and a resume is never refused for want of a prompt block it could compute.

Decoding. Every output token goes to the front end with its index and the session epoch. The
first checkpoint covers the first output token, so that whoever resumes always has a token to
run after the prompt blocks; after it, one goes out whenever a block of generated tokens
completes and at least every 64 output tokens. A deterministic sampler's tokens are posted as
soon as they are drawn. A non-deterministic one's are held until the PC has acknowledged a
checkpoint that covers them, ``KVSP_CHECKPOINT_TOKENS`` at a time (the first at once, for the
time to first token). A generated block is stored, published and copied only after the
checkpoint covering it was acknowledged, so an instance whose epoch has passed never publishes
for the session again.

Resume. The blocks the PC listed are loaded as a prefetch directive (leases at the sources,
verified retrieval, stored and published), on a thread of its own, while the longest prefix of
the checkpoint's blocks held or listed is imported as they are admitted (the prefix then held,
should the directive end short); prompt_tail and the covered generated tokens after it are
recomputed; the sampler is restored at its step. The covered tokens the front end does not have
yet (their instance may have died between a checkpoint and their release) are delivered first,
and generation continues at output_offset under the new epoch.

Stale epochs. An answer of kvsp-stale-epoch, or one saying another instance serves the session,
ends the session here at once: nothing more is sent for it.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import connections
from django.utils import timezone

from common.peers import PeerUnreachable
from kvsp import blockkeys
from kvsp.problems import ProtocolError
from kvsp.records import MAX_TOKENS_PARAM, GenerateRequest, Sampler, SessionCheckpoint
from kvsp.states import ServedSessionEvent
from kvsp.timeline import StepTimer
from workers import admission, control_plane, directives, fetch, notices, replicas, served_sessions
from workers.models import Directive, DirectiveState, ServedSession, SessionKind, StoredBlock
from workers.tiers import Geometry, HeldLayers

log = logging.getLogger(__name__)

# 6.8: a checkpoint at least every 64 output tokens.
CHECKPOINT_INTERVAL = 64
# How long a generation waits for the directive of its request_ref to arrive: the PC sends it
# right after it answers the placement, so it is normally here first.
DIRECTIVE_ARRIVAL_S = 2.0
# Past a directive's deadline, how long its loads may take to stop before the generation goes
# on without waiting.
DIRECTIVE_SLACK_S = 2.0
# A layer of an import that does not arrive in this time ends the import.
IMPORT_TIMEOUT_S = 120.0
# How long a call to the control plane is retried while it cannot be reached. By then the PC,
# judging by its own clock, has failed the instance over if it has not heard from it either.
CONTROL_RETRY_S = 30.0
# Problems with which the PC says that the session is no longer this instance's to serve.
SUPERSEDING_PROBLEMS = ("kvsp-stale-epoch", "kvsp-forbidden")
# Records published, and copies sent to session holders, at the same time.
PUBLISH_PARALLEL = 8


class Superseded(Exception):
    """The PC answered that the session runs under a higher epoch or on another instance."""


# --- The prompt --------------------------------------------------------------------------------


def held_prefix(
    name: str, compat_id: bytes, scope_id: bytes, keys: list[bytes]
) -> list[StoredBlock]:
    """The held blocks of the longest prefix of ``keys`` the tier store holds (keys are
    chained, 4.2: a block is of use only after all the blocks before it)."""
    rows = StoredBlock.objects.filter(
        instance=name,
        compat_id=compat_id,
        scope_id=scope_id,
        block_key__in=keys,
        pending_move__isnull=True,
    )
    by_key = {bytes(row.block_key): row for row in rows}
    prefix = []
    for key in keys:
        row = by_key.get(key)
        if row is None:
            break
        prefix.append(row)
    return prefix


def run_after_blocks(engine, tier_store, blocks: list[StoredBlock], block_tokens, rest):
    """A sequence whose cache starts with ``blocks`` imported from the tier store layer by
    layer, with ``rest`` run after them: the forward pass takes layer l as soon as layer l of
    every block has arrived (4.3). ``block_tokens`` are the tokens the blocks cover, or None
    when they are known by key alone."""
    if not blocks:
        return engine.prefill(rest)
    layerwise = engine.begin_import(len(blocks), tokens=block_tokens, timeout=IMPORT_TIMEOUT_S)
    geometry = Geometry.from_descriptor(engine.descriptor)

    def feed() -> None:
        for layer, index, k, v in tier_store.layers_in_order(blocks, geometry):
            layerwise.add_layer(index, layer, k, v)

    return _extend_while_feeding(engine, layerwise, feed, rest)


def _extend_while_feeding(engine, layerwise, feed, rest):
    """Run ``rest`` after the blocks of ``layerwise`` while ``feed`` hands it their layers on
    a thread of its own; whatever ``feed`` raises ends the import, and the forward pass raises
    it."""

    def run() -> None:
        try:
            feed()
        except BaseException as error:
            layerwise.fail(error)
        finally:
            connections.close_all()

    feeder = threading.Thread(target=run, name="kvsp-import", daemon=True)
    feeder.start()
    try:
        engine.extend(layerwise.sequence, rest)
    except BaseException as error:
        layerwise.fail(error)
        raise
    finally:
        feeder.join()
    return layerwise.sequence


class PrefixNotLoaded(Exception):
    """A block that an import waited for was not admitted: its directive ended or passed its
    deadline without it."""


def import_as_admitted(
    engine,
    runtime,
    compat_id: bytes,
    scope_id: bytes,
    keys: list[bytes],
    directive,
    tokens,
    rest,
    *,
    loading: threading.Thread | None = None,
):
    """Like ``run_after_blocks``, for the blocks of ``keys`` while a prefetch directive of this
    process is still loading some of them: each block is handed to the import as soon as it is
    admitted, every layer of it, so that joining the layers overlaps the loading and the
    forward pass over ``rest`` starts as the last block arrives. PrefixNotLoaded (from the
    forward pass) when the directive ended, or passed its deadline, without one of them.
    ``loading``: the thread that carries the directive out, when it is one of the caller's; its
    end counts as the directive's."""
    layerwise = engine.begin_import(len(keys), tokens=tokens, timeout=IMPORT_TIMEOUT_S)
    geometry = Geometry.from_descriptor(engine.descriptor)
    position = {key: index for index, key in enumerate(keys)}
    limit = directive.deadline_at + timedelta(seconds=DIRECTIVE_SLACK_S)

    def admitted(pending) -> list[StoredBlock]:
        return list(
            StoredBlock.objects.filter(
                instance=runtime.name,
                compat_id=compat_id,
                scope_id=scope_id,
                block_key__in=pending,
                pending_move__isnull=True,
            )
        )

    def ended() -> bool:
        if loading is not None and not loading.is_alive():
            return True
        directive.refresh_from_db(fields=["state"])
        return directive.state != DirectiveState.PENDING

    def feed() -> None:
        pending = set(keys)
        with HeldLayers(runtime.tier_store, geometry) as held:
            while pending:
                left_s = max((limit - timezone.now()).total_seconds(), 0)
                found = notices.wait_until(lambda: admitted(pending) or ended(), left_s)
                # Admitted meanwhile: the blocks of a directive's last batch are admitted
                # before it ends.
                rows = found if isinstance(found, list) else admitted(pending)
                if not rows:
                    missing = min(pending, key=position.__getitem__)
                    raise PrefixNotLoaded(f"block {missing.hex()} was not loaded")
                for row in rows:
                    index = position[bytes(row.block_key)]
                    for layer in range(geometry.layers):
                        layerwise.add_layer(index, layer, *held.layer(row, layer))
                    pending.discard(bytes(row.block_key))

    return _extend_while_feeding(engine, layerwise, feed, rest)


@dataclass
class ServedPrompt:
    sequence: object
    loaded_blocks: int
    recomputed_tokens: int
    held: set[bytes]


def serve_prompt(
    runtime, engine, compat_id: bytes, scope_id: bytes, keys, tokens, *, recompute, directive=None
):
    """The prompt's cache and the logits of its last token: its leading held blocks imported,
    the rest run (everything with ``recompute``). A held block that cannot be read (evicted or
    moved meanwhile) makes it recompute everything instead.

    ``directive``: the prefetch directive of the request's placement, in this process. While it
    is pending, the leading blocks that are held or that it lists are imported as it admits
    them; should it end without one of them, the prompt is served from what is held then.
    """
    block_tokens = engine.block_tokens
    held = held_prefix(runtime.name, compat_id, scope_id, keys)
    held_keys = {bytes(block.block_key) for block in held}
    last = (len(tokens) - 1) // block_tokens
    if directive is not None and not recompute and directive.state == DirectiveState.PENDING:
        listed = directive.body.get("blocks", ())
        coming = held_keys | {bytes.fromhex(block["block_key"]) for block in listed}
        wanted = list(itertools.takewhile(coming.__contains__, keys[:last]))
        if len(wanted) > len(held[:last]):
            covered = len(wanted) * block_tokens
            try:
                sequence = import_as_admitted(
                    engine,
                    runtime,
                    compat_id,
                    scope_id,
                    wanted,
                    directive,
                    tokens[:covered],
                    tokens[covered:],
                )
            except PrefixNotLoaded as error:
                log.info("the prompt's prefix was not all loaded (%s): serving what is", error)
            except (OSError, TimeoutError, ProtocolError) as error:
                log.warning("the prompt's loaded blocks could not be imported (%s)", error)
            else:
                held = held_prefix(runtime.name, compat_id, scope_id, keys)
                held_keys = {bytes(block.block_key) for block in held}
                return ServedPrompt(sequence, len(wanted), len(tokens) - covered, held_keys)
            wait_for_end(directive)
            return serve_prompt(runtime, engine, compat_id, scope_id, keys, tokens, recompute=False)
    usable = [] if recompute else held[:last]
    if usable:
        covered = len(usable) * block_tokens
        try:
            sequence = run_after_blocks(
                engine, runtime.tier_store, usable, tokens[:covered], tokens[covered:]
            )
            return ServedPrompt(sequence, len(usable), len(tokens) - covered, held_keys)
        except (OSError, TimeoutError, ProtocolError) as error:
            log.warning("the prompt's held blocks could not be imported (%s): recomputing", error)
    return ServedPrompt(engine.prefill(tokens), 0, len(tokens), held_keys)


def directive_of(name: str, request_ref: str) -> Directive | None:
    """The prefetch directive of ``request_ref``, waiting for it to arrive for
    DIRECTIVE_ARRIVAL_S; None when none came. This process loads directives, and notifies
    when one starts, admits a batch and ends (``workers.notices``)."""
    rows = Directive.objects.filter(instance=name, request_ref=request_ref).order_by("-received_at")
    return notices.wait_until(rows.first, DIRECTIVE_ARRIVAL_S)


def wait_for_end(row: Directive) -> Directive:
    """``row`` once it has ended (or passed its deadline) or has every block in this
    instance's tiers (the last records may still be on their way to the IS)."""
    limit = row.deadline_at + timedelta(seconds=DIRECTIVE_SLACK_S)
    wanted = len(row.body.get("blocks", ()))

    def ended():
        row.refresh_from_db(fields=["state", "loaded"])
        return row.state != DirectiveState.PENDING or len(row.loaded) >= wanted

    notices.wait_until(ended, max((limit - timezone.now()).total_seconds(), 0))
    return row


def wait_for_directive(name: str, request_ref: str) -> Directive | None:
    """The prefetch directive of ``request_ref`` once it has ended (``wait_for_end``), waiting
    for it to arrive for DIRECTIVE_ARRIVAL_S; None when none came."""
    row = directive_of(name, request_ref)
    return wait_for_end(row) if row is not None else None


def prompt_logits(runtime, scope_id: bytes, compat_id: bytes, tokens, *, recompute) -> dict:
    """The next-token logits of a prompt as this instance serves one: the leading blocks its
    tier store holds imported, the rest computed (all of it with ``recompute``). Returns the
    block and token counts and the logits as float32 octets, little-endian, in base64."""
    engine = _engine_for(runtime, compat_id)
    keys = blockkeys.block_keys(
        control_plane.scope_key(scope_id), compat_id, tokens, engine.block_tokens
    )
    served_prompt = serve_prompt(
        runtime, engine, compat_id, scope_id, keys, list(tokens), recompute=recompute
    )
    logits = served_prompt.sequence.logits.detach().to("cpu").float().contiguous()
    return {
        "loaded_blocks": served_prompt.loaded_blocks,
        "recomputed_tokens": served_prompt.recomputed_tokens,
        "logits": base64.b64encode(logits.numpy().astype("<f4").tobytes()).decode(),
    }


def _engine_for(runtime, compat_id: bytes):
    engine = runtime.engine() if runtime is not None else None
    if engine is None:
        raise ProtocolError("kvsp-invalid-state", "this worker runs no engine")
    if engine.compat_id != compat_id.hex():
        raise ProtocolError(
            "kvsp-compat-mismatch",
            f"this instance's engine serves compat {engine.compat_id}, not {compat_id.hex()}",
        )
    return engine


# --- A session ---------------------------------------------------------------------------------


class SessionRun:
    """One session served under one epoch: ``run`` returns the row's final state."""

    def __init__(self, row: ServedSession, runtime):
        self.row = row
        self.runtime = runtime
        self.name = row.instance
        self.session = str(row.session)
        self.epoch = row.epoch
        self.compat_id = bytes(row.compat_id)
        self.scope_id = bytes(row.scope_id)
        self.engine = None
        self.sequence = None
        self.sampler = None
        self.chain: blockkeys.BlockKeyChain | None = None
        self.prompt_blocks: tuple[str, ...] = ()
        self.prompt_tail: tuple[int, ...] = ()
        self.max_tokens = 0
        self.generated: list[int] = []
        # Output indices drawn and not yet posted, and how many the front end has been sent.
        self.unreleased: list[int] = []
        self.released = row.output_offset
        # A resume's indices after its checkpoint that the front end holds already: drawn again
        # exactly by a deterministic sampler (6.8), so not posted again one round trip each.
        self.delivered_earlier: set[int] = set()
        # The output_offset of this epoch's last acknowledged checkpoint (None: none yet).
        self.acknowledged: int | None = None
        self.checkpoints = 0
        # Completed blocks (index, key) waiting for a checkpoint that covers them.
        self.completed: list[tuple[int, bytes]] = []
        self.writer = BlockWriter(self)
        # The prompt blocks computed here and the names checkpoints may use once they exist
        # elsewhere: written to the node's own tiers right after the first token is posted.
        self.unstored_prompt: tuple[list[tuple[int, bytes]], tuple] | None = None
        self.loaded_blocks = 0
        self.recomputed_tokens = 0
        self.first_token_at = None
        # Whether the session's last output token has been drawn.
        self.ended = False
        # Where the time to the first output token goes: waiting in the queue, the directive
        # (or a resume's loading), the prompt (imported and computed), the first checkpoint,
        # the first token's post.
        self.timer = StepTimer()
        if row.started_at is not None:
            self.timer.add("queued", (row.started_at - row.received_at).total_seconds() * 1e6)

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> str:
        event, reason = self._serve()
        # Blocks still waiting to be stored are dropped once the session is superseded:
        # nothing more goes out for it.
        self.writer.close(discard=event is ServedSessionEvent.SUPERSEDE)
        self.sequence = None
        return served_sessions.do_finish(self.row.pk, event, reason, **self._progress())

    def _serve(self) -> tuple[ServedSessionEvent, str]:
        try:
            self.engine = _engine_for(self.runtime, self.compat_id)
            if self.row.kind == SessionKind.GENERATE:
                self._begin_generation()
            else:
                self._begin_resume()
            self._decode()
            self._store_prompt()  # a session that ended without posting a token
        except Superseded as stop:
            log.info("session %s epoch %d: superseded (%s)", self.session, self.epoch, stop)
            return ServedSessionEvent.SUPERSEDE, str(stop)
        except ProtocolError as error:
            log.warning("session %s epoch %d failed: %s", self.session, self.epoch, error.detail)
            return ServedSessionEvent.FAIL, error.detail
        except PeerUnreachable as error:
            return ServedSessionEvent.FAIL, f"the control plane could not be reached: {error}"
        except Exception:
            log.exception("session %s epoch %d failed", self.session, self.epoch)
            return ServedSessionEvent.FAIL, "the instance failed while serving the session"
        return ServedSessionEvent.COMPLETE, ""

    def _progress(self) -> dict:
        return {
            "produced": len(self.generated),
            "released": self.released,
            "checkpoint_offset": self.acknowledged or self.row.checkpoint_offset,
            "checkpoints": self.checkpoints,
            "loaded_blocks": self.loaded_blocks,
            "recomputed_tokens": self.recomputed_tokens,
            "published_blocks": self.writer.stored,
            "first_token_at": self.first_token_at,
            "timings_us": self.timer.spent,
        }

    # -- the start of a generation and of a resume ----------------------------------------------

    def _begin_generation(self) -> None:
        request = GenerateRequest.from_json(self.row.body)
        engine, block_tokens = self.engine, self.engine.block_tokens
        scope_key = control_plane.scope_key(self.scope_id)
        prompt = list(request.prompt)
        keys = blockkeys.block_keys(scope_key, self.compat_id, prompt, block_tokens)
        self.timer.lap("keys")
        directive = directive_of(self.name, request.request_ref) if request.request_ref else None
        self.timer.lap("directive")
        prompt_served = serve_prompt(
            self.runtime,
            engine,
            self.compat_id,
            self.scope_id,
            keys,
            prompt,
            recompute=False,
            directive=directive,
        )
        self.sequence = prompt_served.sequence
        self.loaded_blocks = prompt_served.loaded_blocks
        self.recomputed_tokens = prompt_served.recomputed_tokens
        # Checkpoints name the leading blocks that were held already; the prompt blocks
        # computed here go to the node's own tiers now and are published and copied to the
        # session holders off the token path, and named once they exist elsewhere. Until
        # then the checkpoint carries their tokens in prompt_tail, so a resume recomputes them.
        named = 0
        while named < len(keys) and keys[named] in prompt_served.held:
            named += 1
        self._name_prompt(keys[:named], prompt[named * block_tokens :])
        self.unstored_prompt = (
            [(index, key) for index, key in enumerate(keys) if key not in prompt_served.held],
            (keys, prompt[len(keys) * block_tokens :]),
        )
        self.chain = blockkeys.BlockKeyChain.after(scope_key, self.compat_id, block_tokens, keys)
        self.chain.extend(prompt[len(keys) * block_tokens :])
        self.sampler = _token_sampler(request.sampler.record())
        self.max_tokens = request.max_tokens
        self.timer.lap("prompt")

    def _begin_resume(self) -> None:
        request = served_sessions.resume_request(self.session, self.row.body)
        checkpoint = request.checkpoint
        block_tokens = self.engine.block_tokens
        scope_key = control_plane.scope_key(self.scope_id)
        prompt_keys = [bytes.fromhex(key) for key in checkpoint.prompt_blocks]
        after = list(checkpoint.prompt_tail) + list(checkpoint.covered_generated)
        self.chain = blockkeys.BlockKeyChain.after(
            scope_key, self.compat_id, block_tokens, prompt_keys
        )
        keys = prompt_keys + self.chain.extend(after)
        self.sequence, self.loaded_blocks, held = self._resume_prefix(keys, prompt_keys, after)
        covered = (self.loaded_blocks - len(prompt_keys)) * block_tokens
        self.recomputed_tokens = len(after) - covered
        self.prompt_blocks = checkpoint.prompt_blocks
        self.prompt_tail = checkpoint.prompt_tail
        self.generated = list(checkpoint.covered_generated)
        self.sampler = _token_sampler(checkpoint.sampler)
        self.max_tokens = served_sessions.split_max_tokens(checkpoint.sampler)[1] or (
            self.engine.max_positions - self.sequence.length + len(self.generated)
        )
        self.timer.lap("prompt")
        # Under its new epoch the session is this instance's from the first checkpoint on.
        self._checkpoint()
        held_keys = {bytes(block.block_key) for block in held}
        # Blocks of prompt_tail and of the covered tokens computed here: stored once the first
        # token is out, published off the token path; the prompt's among them are named once
        # they exist elsewhere.
        tail_blocks = len(checkpoint.prompt_tail) // block_tokens
        self.unstored_prompt = (
            [
                (index, keys[index])
                for index in range(len(prompt_keys), self.sequence.complete_blocks)
                if keys[index] not in held_keys
            ],
            (
                keys[: len(prompt_keys) + tail_blocks],
                list(checkpoint.prompt_tail[tail_blocks * block_tokens :]),
            ),
        )
        self._deliver_covered()

    def _resume_prefix(self, keys, prompt_keys, after) -> tuple[object, int, list]:
        """The resumed sequence: the longest prefix of ``keys`` this instance holds (at least
        the checkpoint's prompt blocks) imported and ``after`` run after it; how many blocks it
        imported, and the held prefix of ``keys`` then. While the resume's directive is loading,
        its blocks are imported as they are admitted (``import_as_admitted``)."""
        block_tokens = self.engine.block_tokens

        def usable(count: int) -> int:
            # Something after the blocks must run, for the logits of the next output token;
            # the admission made sure that the checkpoint has a token after its prompt blocks.
            while (count - len(prompt_keys)) * block_tokens >= len(after):
                count -= 1
            return count

        directive = None
        if self.row.directive_id is not None:
            directive = Directive.objects.filter(pk=self.row.directive_id).first()
        if directive is not None and directive.state == DirectiveState.PENDING:
            loading = threading.Thread(
                target=self._load_resume_blocks, name="kvsp-resume-load", daemon=True
            )
            loading.start()
            self.timer.lap("directive")
            held = held_prefix(self.name, self.compat_id, self.scope_id, keys)
            listed = directive.body.get("blocks", ())
            coming = {bytes(block.block_key) for block in held}
            coming |= {bytes.fromhex(block["block_key"]) for block in listed}
            count = usable(sum(1 for _ in itertools.takewhile(coming.__contains__, keys)))
            if count >= len(prompt_keys) and count > len(held):
                covered = (count - len(prompt_keys)) * block_tokens
                try:
                    sequence = import_as_admitted(
                        self.engine,
                        self.runtime,
                        self.compat_id,
                        self.scope_id,
                        keys[:count],
                        directive,
                        None,
                        after[covered:],
                        loading=loading,
                    )
                except PrefixNotLoaded as error:
                    log.info("the resumed prefix was not all loaded (%s)", error)
                except (OSError, TimeoutError, ProtocolError) as error:
                    log.warning("the resumed prefix could not be imported (%s)", error)
                else:
                    held = held_prefix(self.name, self.compat_id, self.scope_id, keys)
                    return sequence, count, held
            loading.join()
        self.timer.lap("directive")
        held = held_prefix(self.name, self.compat_id, self.scope_id, keys)
        if len(held) < len(prompt_keys):
            missing = prompt_keys[len(held)].hex()
            if directive is not None:
                directive.refresh_from_db(fields=["reason"])
            why = f": {directive.reason}" if directive is not None and directive.reason else ""
            raise ProtocolError(
                "kvsp-not-found", f"prompt block {missing} could not be loaded{why}"
            )
        count = usable(len(held))
        covered = (count - len(prompt_keys)) * block_tokens
        sequence = run_after_blocks(
            self.engine, self.runtime.tier_store, held[:count], None, after[covered:]
        )
        return sequence, count, held

    def _load_resume_blocks(self) -> None:
        """The resume's directive, carried out on a thread of its own while the import waits
        for its blocks; an instance that cannot carry it out leaves it pending, and the import
        sees this thread end."""
        try:
            directives.run_directive(self.row.directive_id, self.runtime.device_tier, admitted=True)
        except Exception:  # noqa: BLE001 - the resume reports the blocks it lacks
            log.exception("session %s: loading the resume's blocks failed", self.session)
        finally:
            connections.close_all()

    def _deliver_covered(self) -> None:
        """Post the covered tokens the front end lacks: the instance that drew them may have
        died between a checkpoint and their release. Each index is kept once there. When the
        covered tokens end the session already, the last one goes again, marked final. With a
        deterministic sampler the failed instance may also have released tokens after the
        checkpoint; those indices are remembered, and drawing them again posts nothing."""
        covered = len(self.generated)
        if not covered and not self.sampler.deterministic:
            return
        have = self._call(control_plane.delivered_indices, self.session)
        if self.sampler.deterministic:
            self.delivered_earlier = {index for index in have if index >= covered}
        if not covered:
            return
        self.unreleased = [index for index in range(covered) if index not in have]
        self.ended = covered >= self.max_tokens or self.generated[-1] == self.engine.eos_token_id
        if self.ended and covered - 1 not in self.unreleased:
            self.unreleased.append(covered - 1)
        self.released = covered - len(self.unreleased)
        if self.unreleased:
            self._post(final=self.ended)

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self) -> None:
        engine, sampler = self.engine, self.sampler
        batch = settings.KVSP_CHECKPOINT_TOKENS
        while not self.ended and len(self.generated) < self.max_tokens:
            token = sampler.sample(self.sequence.logits)
            self.generated.append(token)
            final = len(self.generated) >= self.max_tokens or token == engine.eos_token_id
            index = len(self.generated) - 1
            if index in self.delivered_earlier and not final:
                self.released += 1
            else:
                self.unreleased.append(index)
            first = self.acknowledged is None
            if final or first or (not sampler.deterministic and len(self.unreleased) >= batch):
                self._checkpoint(release=True, final=final)
            elif sampler.deterministic:
                self._post(final=final)
            if final:
                self.ended = True
                return
            engine.decode(self.sequence, token)
            for key in self.chain.extend([token]):
                self.completed.append((self.sequence.complete_blocks - 1, key))
            due = len(self.generated) - (self.acknowledged or 0) >= CHECKPOINT_INTERVAL
            if self.completed or due:
                self._checkpoint(release=True)
                self.writer.store_later(self.completed)
                self.completed = []

    # -- messages ---------------------------------------------------------------------------

    def _call(self, function, *args):
        """A call to the control plane, retried while it cannot be reached; an answer that the
        session is no longer this instance's raises Superseded."""
        give_up = time.monotonic() + CONTROL_RETRY_S
        pause = 0.05
        while True:
            try:
                return function(*args)
            except ProtocolError as error:
                if error.problem in SUPERSEDING_PROBLEMS:
                    raise Superseded(f"{error.problem}: {error.detail}") from None
                raise
            except PeerUnreachable:
                if time.monotonic() >= give_up:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _sampler_record(self) -> Sampler:
        record = self.sampler.to_record()
        params = dict(record.params.to_json())
        params[MAX_TOKENS_PARAM] = self.max_tokens
        return Sampler(
            method=record.method,
            params=params,
            seed=record.seed,
            step=record.step,
            deterministic=record.deterministic,
        )

    def _name_prompt(self, keys: list[bytes], tail) -> None:
        self.prompt_blocks = tuple(key.hex() for key in keys)
        self.prompt_tail = tuple(tail)

    def _checkpoint(self, *, release: bool = False, final: bool = False) -> None:
        """Publish a checkpoint covering every output token drawn so far (4.4, 6.8); with
        ``release``, the tokens not yet sent go with it (``final``: the last one ends the
        session)."""
        named = self.writer.prompt_named()
        if named is not None:
            self._name_prompt(*named)
        offset = len(self.generated)
        record = SessionCheckpoint(
            session=self.session,
            epoch=self.epoch,
            compat_id=self.compat_id.hex(),
            scope_id=self.scope_id.hex(),
            prompt_blocks=tuple(self.prompt_blocks),
            prompt_tail=tuple(self.prompt_tail),
            generated=tuple(self.generated),
            output_offset=offset,
            sampler=self._sampler_record(),
        )
        first = self.acknowledged is None
        if first:
            self.timer.lap("first_token")  # drawing it (a resume: its covered tokens' logits)
        extensions = {"timings_us": dict(self.timer.spent)} if first else None
        # Everything drawn so far is covered by this checkpoint, so its tokens may go with it
        # whatever the sampler: the PC records the checkpoint before it takes them.
        items = self._releasable(offset, final) if release else []
        self._call(partial(control_plane.put_checkpoint, release=items), record, extensions)
        if first:
            self.timer.lap("first_checkpoint")
        # The PC holds this checkpoint or one further on, under this epoch: everything drawn
        # so far is covered.
        self.acknowledged = offset
        self.checkpoints += 1
        if items:
            self._released(items)
        served_sessions.do_note_progress(self.row.pk, **self._progress())

    def _post(self, *, final: bool) -> None:
        """Release the drawn tokens not yet sent: all of them for a deterministic sampler,
        those an acknowledged checkpoint covers otherwise (the PC would refuse the others)."""
        limit = len(self.generated)
        if not self.sampler.deterministic:
            limit = self.acknowledged or 0
        items = self._releasable(limit, final)
        if items:
            self._call(control_plane.post_output, self.session, items)
            self._released(items)

    def _releasable(self, limit: int, final: bool) -> list[dict]:
        """The output tokens not yet sent below index ``limit``, as posted (6.8)."""
        items = [
            {"epoch": self.epoch, "index": index, "token": self.generated[index]}
            for index in self.unreleased
            if index < limit
        ]
        if items and final and items[-1]["index"] == len(self.generated) - 1:
            items[-1]["final"] = True
        return items

    def _released(self, items: list[dict]) -> None:
        sent = {item["index"] for item in items}
        self.unreleased = [index for index in self.unreleased if index not in sent]
        self.released += len(sent)
        if self.first_token_at is None:
            self.first_token_at = timezone.now()
            self.timer.lap("first_post")
            self._store_prompt()
            served_sessions.do_note_progress(self.row.pk, timings_us=self.timer.spent)

    def _store_prompt(self) -> None:
        """Write the prompt blocks computed here to the node's own tiers (their publication
        and copies follow off the token path). It runs once the first token is out: exporting
        and writing a long prompt's blocks would otherwise be part of its time to first token."""
        if self.unstored_prompt is not None:
            blocks, named = self.unstored_prompt
            self.unstored_prompt = None
            self.writer.store_prompt(blocks, named=named)

    def export(self, index: int, key: bytes) -> tuple:
        """Block ``index`` of the session's cache as a container, with its ids."""
        encoded = self.engine.export_blocks(self.sequence, index, 1)[0]
        return (self.compat_id, self.scope_id, key), encoded


class BlockWriter:
    """Stores the blocks a session computed, publishes their records (6.1) and copies them to
    the session holders, on a thread of the writer's own, so that neither the first token nor
    decoding waits for publication. ``store_prompt`` writes the prompt's blocks to the node's
    own tiers before it returns (a local write) and hands their publication and copies to the
    thread; ``prompt_named`` then says, once every one of them exists at a session holder
    too, which keys and tail the checkpoints may name. ``store_later`` hands generated blocks
    over whole. Blocks are exported from the engine's cache on the caller's thread, which is
    the one that owns the sequence."""

    def __init__(self, run: SessionRun):
        self.run = run
        self.stored = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._discard = threading.Event()
        self._named = None
        self._named_ready = threading.Event()

    def store_prompt(self, blocks: list[tuple[int, bytes]], *, named) -> None:
        self._named = named
        if not blocks:  # every block was held already
            self._named_ready.set()
            return
        exported = [self.run.export(index, key) for index, key in blocks]
        stored = admission.do_store_exported(exported, self.run.engine.block_tokens)
        self.stored += len(stored)
        self._put(("prompt", stored, exported))

    def prompt_named(self):
        """``(keys, tail)`` the checkpoints name from now on, or None while the prompt's
        blocks exist here alone."""
        if self._named_ready.is_set():
            named, self._named = self._named, None
            self._named_ready.clear()
            return named
        return None

    def store_later(self, blocks: list[tuple[int, bytes]]) -> None:
        if blocks:
            self._put(("generated", [self.run.export(index, key) for index, key in blocks]))

    def _put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="kvsp-blocks", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _drain(self) -> None:
        try:
            while True:
                jobs = [self._queue.get()]
                while not self._queue.empty():
                    jobs.append(self._queue.get())
                done = jobs[-1] is None
                generated = []
                for job in jobs:
                    if job is None or self._discard.is_set():
                        continue
                    if job[0] == "prompt":
                        if publish_and_copy(job[1], job[2]):
                            self._named_ready.set()
                    else:
                        generated += job[1]
                if generated:
                    self.stored += store_blocks(generated, self.run.engine.block_tokens)
                if done:
                    return
        except Exception:
            log.exception("session %s: blocks could not be stored", self.run.session)
        finally:
            connections.close_all()

    def close(self, *, discard: bool) -> None:
        """Wait for the blocks handed over (or drop those not stored yet, with ``discard``)."""
        if discard:
            self._discard.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def store_blocks(blocks: list[tuple], token_count: int) -> int:
    """Store exported blocks in the tier store, then publish the records of those newly stored
    and copy every one to the session holders. Returns how many were newly stored."""
    stored = admission.do_store_exported(blocks, token_count)
    publish_and_copy(stored, blocks)
    return len(stored)


def publish_and_copy(stored: list[int], blocks: list[tuple]) -> bool:
    """Publish the records of the rows ``stored`` (in batches) and copy every block to the
    session holders, PUBLISH_PARALLEL at a time. True when every block exists elsewhere now: at a
    session holder (and, when newly stored, in the index)."""
    jobs = [lambda: replicas.publish_all(stored) == len(stored)] if stored else []
    jobs += [partial(copy_to_session_holders, ids, encoded) for ids, encoded in blocks]
    return all(_run_all(jobs))


def _run_all(jobs) -> list:
    def run(job):
        try:
            return job()
        finally:
            connections.close_all()

    if len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(PUBLISH_PARALLEL, len(jobs))) as pool:
        return list(pool.map(run, jobs))


def copy_to_session_holders(ids, encoded) -> bool:
    """PUT a block at each session holder (6.7); a holder that has it already keeps its copy.
    True when at least one session holder has it; a failure is logged."""
    holders = [h for h in settings.KVSP_SESSION_HOLDERS if h != settings.KVSP_PUBLIC_URL]
    if not holders:
        return False
    octets = encoded.tobytes()
    sha256 = hashlib.sha256(octets).digest()
    copied = False
    for holder in holders:
        try:
            token = control_plane.delegated_token(ids[1], holder)
            fetch.store_block(
                control_plane.holder_client(), holder, ids, octets, sha256, token=token
            )
            copied = True
        except (ProtocolError, PeerUnreachable, fetch.DeadlineExpired) as error:
            log.warning("block %s not copied to %s: %s", ids[2].hex(), holder, error)
    return copied


def _token_sampler(record: Sampler):
    from workers.engines.samplers import TokenSampler

    params = served_sessions.split_max_tokens(record)[0]
    return TokenSampler(record.method, params, seed=record.seed, step=record.step)


def serve(session_pk: int, runtime) -> str:
    """Serve an admitted session (the task ``workers.serve_session``); a row taken up already
    (a task delivered again) is left as it is."""
    row = ServedSession.objects.filter(pk=session_pk).first()
    if row is None:
        return "gone"
    if not served_sessions.do_start(session_pk, runtime.epoch if runtime is not None else 0):
        return ServedSession.objects.get(pk=session_pk).state
    row.refresh_from_db()
    if runtime is None:
        return served_sessions.do_finish(
            session_pk, ServedSessionEvent.FAIL, "this worker does not serve the node's queue"
        )
    return SessionRun(row, runtime).run()
