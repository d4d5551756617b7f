"""HTTP surface of a node (DESIGN.md section 3): blocks (spec 6.7), leases (6.6), prefetch
directives (6.5), the instance's state (6.3), session resume (6.8), resharding (6.9), and this
implementation's own generation request. Views validate and translate HTTP; the services do the
work.

Who may call what: blocks and leases need a principal authorized for the scope (a controller
principal reads every scope), or a delegated token of the scope meant for this holder (DESIGN.md
section 6), and a scope the caller may not read answers exactly like a miss;
prefetch, state, resume and reshard are the Placement Controller's alone; generate is the
controller's or a principal's of the prompt's scope.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import (
    UINT16_MAX,
    UINT32_MAX,
    LeaseRenewal,
    LeaseRequest,
    PrefetchDirective,
    ReshardPlan,
    parse_reshard_body,
)
from kvsp.reprdigest import claimed_sha256, verify_repr_digest
from kvspsite.api import (
    KVSP_BLOCK,
    HolderAuthentication,
    KvspBlockParser,
    KvspBlockRenderer,
    KvspJSONRenderer,
    PlainJSONRenderer,
    ReceivedContainer,
    holder_principal,
    problem_http_response_for,
)
from workers import resharding, selectors, services, serving, sessions, tiers
from workers.models import Directive

# Accept fields of a block GET that only the container answers.
_BLOCK_ACCEPT = (None, "*/*", KVSP_BLOCK)
# The requests BlockView answers on its lean path, and the Allow field DRF gives its answers.
_LEAN_METHODS = ("GET", "HEAD")
_BLOCK_ALLOW = "GET, PUT, HEAD, OPTIONS"


def _node_url(request, path: str) -> str:
    base = settings.KVSP_PUBLIC_URL or request.build_absolute_uri("/kvsp/")
    return base + path


def _require_controller(principal) -> None:
    if not principal.controller:
        raise ProtocolError("kvsp-forbidden", "only the Placement Controller's principal may")


def _layers(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, dash, last = value.partition("-")
    if not dash:
        raise ProtocolError(
            "kvsp-malformed-request", f"layers={value!r}: use layers=a-b (inclusive, a <= b)"
        )
    first = parse_decimal(first, f"layers={value!r}: a", maximum=UINT32_MAX)
    last = parse_decimal(last, f"layers={value!r}: b", maximum=UINT32_MAX)
    if first > last:
        raise ProtocolError("kvsp-malformed-request", f"layers={value}: a must not exceed b")
    return first, last


def _codec(value: str | None) -> int | None:
    if value is None:
        return None
    return parse_decimal(value, f"codec={value!r}: a codec", maximum=UINT16_MAX)


def _object(data) -> dict:
    if not isinstance(data, dict):
        raise ProtocolError("kvsp-malformed-request", "the body must be a JSON object")
    return data


def _block_get(principal, params, compat_id: bytes, scope_id: bytes, block_key: bytes):
    """The answer to a block GET or HEAD by ``principal``, on either path (``BlockView``)."""
    layers = _layers(params.get("layers"))
    codec = _codec(params.get("codec"))
    block = selectors.read_block(principal, compat_id, scope_id, block_key)
    if block is None:
        raise ProtocolError("kvsp-not-found", selectors.MISS_DETAIL)
    if codec is not None and codec != block.codec:
        raise ProtocolError(
            "kvsp-unsupported-codec",
            f"this holder serves the block in codec {block.codec} only; it does not transcode",
        )
    if layers is not None and layers[1] >= block.layer_count:
        raise ProtocolError(
            "kvsp-layers-unavailable",
            f"this holder holds layers 0-{block.layer_count - 1} of the block",
        )
    return serving.block_response(block, layers)


class BlockView(APIView):
    """One block resource (6.7): GET a container or a layer range of it, PUT to store one."""

    # The docstring above is the route's description in OPTIONS and OpenAPI; why GET has a
    # path of its own is said at ``as_view``.

    parser_classes = [KvspBlockParser]
    authentication_classes = [HolderAuthentication]

    @classmethod
    def as_view(cls, **initkwargs):
        """DRF's view, but for the GETs and HEADs a loader sends (one per block, thousands per
        directive) that ask for the container (no Accept, ``*/*`` or
        ``application/kvsp-block``): ``lean_get`` answers them as a plain Django view, with the
        same checks (``holder_principal``: a bearer or delegated token, the auth cache, the
        failed-auth budget, the principal's rate), the same answers and the same headers,
        without DRF's request wrapping, dispatch, negotiation and rendering, which cost more
        CPU than the rest of the request. Everything else (PUT, OPTIONS, another Accept, a
        method not allowed) goes through DRF as before, and OpenAPI documents the view as DRF
        declares it."""
        drf_view = super().as_view(**initkwargs)

        def view(request, compat_id: bytes, scope_id: bytes, block_key: bytes):
            if request.method in _LEAN_METHODS and request.META.get("HTTP_ACCEPT") in _BLOCK_ACCEPT:
                return cls.lean_get(request, compat_id, scope_id, block_key)
            return drf_view(request, compat_id=compat_id, scope_id=scope_id, block_key=block_key)

        # What URL resolution, CSRF and drf-spectacular read of a view (cls, initkwargs,
        # csrf_exempt) stays DRF's.
        view.__dict__.update(drf_view.__dict__)
        view.__doc__ = drf_view.__doc__
        return view

    @staticmethod
    def lean_get(request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        """A block GET or HEAD answered as DRF would answer it, at a fraction of the CPU."""
        try:
            principal = holder_principal(request)
            response = _block_get(principal, request.GET, compat_id, scope_id, block_key)
        except Exception as exc:  # noqa: BLE001 - every error leaves as problem details
            response = problem_http_response_for(exc, "BlockView")
        # DRF adds these to every response of the view; a lean answer is not told apart.
        response["Allow"] = _BLOCK_ALLOW
        response["Vary"] = "Accept"
        return response

    def get_renderers(self):
        if self.request is not None and self.request.method in ("GET", "HEAD"):
            return [KvspBlockRenderer()]
        return [KvspJSONRenderer(), PlainJSONRenderer()]

    def perform_content_negotiation(self, request, force=False):
        # What a loader's GETs ask for (hundreds a second) is answered without the negotiation
        # machinery; anything else is negotiated as usual.
        if request.method in ("GET", "HEAD") and request.META.get("HTTP_ACCEPT") in _BLOCK_ACCEPT:
            renderer = KvspBlockRenderer()
            return renderer, renderer.media_type
        return super().perform_content_negotiation(request, force)

    def block_spool(self):
        """Where KvspBlockParser writes a PUT body: the host tier, to be renamed into place."""
        return tiers.new_spool(selectors.node_name())

    def get(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        return _block_get(request.user, request.query_params, compat_id, scope_id, block_key)

    def put(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        if bytes(scope_id) not in request.user.scope_ids:
            raise ProtocolError("kvsp-forbidden", "not authorized for the block's scope")
        if request.headers.get("If-None-Match", "").strip() != "*":
            raise ProtocolError(
                "kvsp-precondition-failed",
                "a block is stored with If-None-Match: * (a holder never replaces a replica)",
                status=status.HTTP_428_PRECONDITION_REQUIRED,
            )
        # Spec 6.7 asks Repr-Digest of what holders return, not of what clients send: a PUT
        # without one is checked as a container alone (``services.check_container``), so a
        # body damaged in transit that still parses is stored as received.
        claimed = request.headers.get("Repr-Digest")
        if claimed is not None:
            claimed_sha256(claimed)  # a malformed field is refused before anything is looked up
        length = request.headers.get("Content-Length", "")
        length = parse_decimal(length, "Content-Length") if length else 0
        if not length:
            raise ProtocolError(
                "kvsp-malformed-request",
                "a block body needs a Content-Length and at least one octet",
                status=status.HTTP_411_LENGTH_REQUIRED,
            )
        if length > settings.KVSP_MAX_BLOCK_OCTETS:
            raise ProtocolError(
                "kvsp-payload-too-large",
                f"a block body is at most {settings.KVSP_MAX_BLOCK_OCTETS} octets",
            )
        ids = (bytes(compat_id), bytes(scope_id), bytes(block_key))
        if selectors.held_block(selectors.node_name(), *ids) is not None:
            raise ProtocolError(
                "kvsp-precondition-failed",
                "this holder already has a replica of the block and keeps its copy",
            )
        received = request.data
        if not isinstance(received, ReceivedContainer):
            raise ProtocolError("kvsp-invalid-container", "the body is not a KV Block Container")
        try:
            if claimed is not None:
                verify_repr_digest(claimed, sha256=received.sha256)
            block = services.do_store_block(ids, received.path, received.container, received.sha256)
        finally:
            received.release()
            Path(received.path).unlink(missing_ok=True)
        path = f"blocks/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}"
        return Response(
            selectors.replica_record(block).to_json(),
            status=status.HTTP_201_CREATED,
            headers={"Location": _node_url(request, path)},
        )


class LeaseListView(APIView):
    """POST leases (6.6)."""

    authentication_classes = [HolderAuthentication]

    def post(self, request):
        grant = services.do_create_lease(request.user, LeaseRequest.from_json(request.data))
        return Response(
            grant.to_json(),
            status=status.HTTP_201_CREATED,
            headers={"Location": _node_url(request, f"leases/{grant.lease}")},
        )


class LeaseView(APIView):
    """Renew (PUT) or release (DELETE) a lease (6.6); only its holder's principal may."""

    authentication_classes = [HolderAuthentication]

    def put(self, request, lease: str):
        grant = services.do_renew_lease(request.user, lease, LeaseRenewal.from_json(request.data))
        return Response(grant.to_json())

    def delete(self, request, lease: str):
        services.do_release_lease(request.user, lease)
        return Response(status=status.HTTP_204_NO_CONTENT)


class PrefetchView(APIView):
    """POST prefetch (6.5): 202 with the directive's status resource as Location."""

    def post(self, request):
        _require_controller(request.user)
        row = services.do_accept_directive(PrefetchDirective.from_json(request.data))
        return Response(
            selectors.directive_state(row).to_json(),
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": _node_url(request, f"prefetch/{row.directive}")},
        )


class DirectiveView(APIView):
    """GET prefetch/{directive} (6.5): its state and the keys loaded so far."""

    def get(self, request, directive: uuid.UUID):
        _require_controller(request.user)
        row = Directive.objects.filter(instance=selectors.node_name(), directive=directive).first()
        if row is None:
            raise ProtocolError("kvsp-not-found", "no such directive")
        return Response(selectors.directive_state(row).to_json())


class StateView(APIView):
    """PUT state (6.3): the state the PC decided for this instance."""

    def put(self, request):
        _require_controller(request.user)
        node = services.do_set_state(_object(request.data).get("state"))
        return Response({"state": node.state})


class GenerateView(APIView):
    """POST generate: a new session from a prompt (this implementation's request, not the
    spec's). 202 with the session's resource at the control plane as Location, where its
    checkpoints and output tokens appear (6.8)."""

    def post(self, request):
        row = sessions.do_accept_generation(request.user, request.data)
        session_url = f"{settings.KVSP_CONTROL_URL}sessions/{row.session}"
        return Response(
            {
                "session": str(row.session),
                "epoch": row.epoch,
                "state": row.state,
                "session_url": session_url,
                "output_url": f"{session_url}/output",
            },
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": session_url},
        )


class ResumeView(APIView):
    """POST sessions/{session}/resume (6.8): the PC hands this instance a failed instance's
    session under a new epoch. 202 once admitted; the worker loads, recomputes and goes on."""

    def post(self, request, session: str):
        _require_controller(request.user)
        row = sessions.do_accept_resume(session, request.data)
        return Response(
            {"session": str(row.session), "epoch": row.epoch, "state": row.state},
            status=status.HTTP_202_ACCEPTED,
        )


class ReshardView(APIView):
    """POST reshard (6.9): a plan, answered 200 once its fetch ranges are loaded; a commit; or
    an abort (see ``workers.resharding``)."""

    def post(self, request):
        _require_controller(request.user)
        body = parse_reshard_body(request.data)
        if isinstance(body, ReshardPlan):
            move = resharding.do_prepare(body, request.data)
        else:
            move = resharding.do_decide(body, request.data)
        return Response(resharding.move_json(move))
