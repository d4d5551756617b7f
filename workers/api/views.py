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
from django.http import StreamingHttpResponse
from rest_framework import status
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from common.api import (
    KVSP_BLOCK,
    KvspBlockParser,
    KvspBlockRenderer,
    KvspJSONRenderer,
    PlainJSONRenderer,
    ReceivedContainer,
    require_object,
)
from common.openapi import (
    BLOCK_RESPONSE_HEADERS,
    CODEC_QUERY,
    IF_NONE_MATCH_HEADER,
    LAYERS_QUERY,
    PROBLEM,
    REPR_DIGEST_HEADER,
    location_header,
    operation,
)
from common.permissions import IsController
from index.authentication import HolderAuthentication
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import (
    BlockBatchRequest,
    DirectiveStatusRecord,
    GenerateRequest,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    PrefetchDirective,
    ReplicaRecord,
    ReshardMoveAnswer,
    ReshardPlan,
    ResumeRequest,
    SessionAdmitted,
    StateAnswer,
    StateChange,
    parse_reshard_body,
)
from kvsp.reprdigest import claimed_sha256, verify_repr_digest
from workers import (
    admission,
    directives,
    instance,
    leases,
    resharding,
    selectors,
    served_sessions,
    serving,
    tiers,
)
from workers.metrics import BLOCKS_SENT
from workers.models import Directive

# Accept fields of a block GET that only the container answers.
BLOCK_ACCEPT = (None, "*/*", KVSP_BLOCK)


def _node_url(request, path: str) -> str:
    base = settings.KVSP_PUBLIC_URL or request.build_absolute_uri("/kvsp/")
    return base + path


class BlockView(APIView):
    """One block resource (6.7): GET a container or a layer range of it, PUT to store one."""

    # The GETs and HEADs a loader sends (the container, thousands per directive) are answered by
    # the node's server itself, beside this view (``workers.blockpath``); this view answers the
    # rest, and documents the route in OPTIONS and OpenAPI.

    parser_classes = [KvspBlockParser]
    authentication_classes = [HolderAuthentication]

    def get_renderers(self):
        if self.request is not None and self.request.method in ("GET", "HEAD"):
            return [KvspBlockRenderer()]
        return [KvspJSONRenderer(), PlainJSONRenderer()]

    def perform_content_negotiation(self, request, force=False):
        # What a loader's GETs ask for (hundreds a second) is answered without the negotiation
        # machinery; anything else is negotiated as usual.
        if request.method in ("GET", "HEAD") and request.META.get("HTTP_ACCEPT") in BLOCK_ACCEPT:
            renderer = KvspBlockRenderer()
            return renderer, renderer.media_type
        return super().perform_content_negotiation(request, force)

    def block_spool(self):
        """Where KvspBlockParser writes a PUT body: the host tier, to be renamed into place."""
        return tiers.new_spool(selectors.node_name())

    @operation(
        responses={200: "BlockContainer", 400: PROBLEM, 404: PROBLEM, 406: PROBLEM},
        parameters=[LAYERS_QUERY, CODEC_QUERY, *BLOCK_RESPONSE_HEADERS],
    )
    def get(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        ids = (bytes(compat_id), bytes(scope_id), bytes(block_key))
        sent = serving.representation_for(request.user, request.query_params, ids)
        if request.method == "GET":
            BLOCKS_SENT.labels("get").inc()
        return serving.block_response(sent)

    @operation(
        "BlockContainer",
        {
            201: ReplicaRecord,
            **dict.fromkeys((400, 403, 411, 412, 413, 415, 422, 428, 503), PROBLEM),
        },
        parameters=[REPR_DIGEST_HEADER, IF_NONE_MATCH_HEADER, location_header(201)],
    )
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
        # without one is checked as a container alone (``admission.check_container``), so a
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
            block = admission.do_store_block(
                ids, received.path, received.container, received.sha256
            )
        finally:
            received.release()
            Path(received.path).unlink(missing_ok=True)
        path = f"blocks/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}"
        return Response(
            selectors.replica_record(block).to_json(),
            status=status.HTTP_201_CREATED,
            headers={"Location": _node_url(request, path)},
        )


class BlockBatchView(APIView):
    """POST blocks/{compat}/{scope}: several blocks of one compat and scope in one answer, a
    ``multipart/mixed`` body of one part per block, each what a GET of the block would answer
    (an extension of 6.7 for loaders; docs/api.md "Blocks in batches")."""

    authentication_classes = [HolderAuthentication]

    def perform_content_negotiation(self, request, force=False):
        # The answer is the multipart body whatever is asked for; an error, problem details.
        renderer = KvspJSONRenderer()
        return renderer, renderer.media_type

    @operation(BlockBatchRequest, {200: "BlockBatch", 400: PROBLEM, 413: PROBLEM, 422: PROBLEM})
    def post(self, request, compat_id: bytes, scope_id: bytes):
        keys = request.data.get("block_keys") if isinstance(request.data, dict) else None
        if isinstance(keys, list) and len(keys) > settings.KVSP_MAX_BATCH_BLOCKS:
            raise ProtocolError(
                "kvsp-payload-too-large",
                f"at most {settings.KVSP_MAX_BATCH_BLOCKS} block_keys per batch",
            )
        asked = BlockBatchRequest.from_json(request.data)
        keys = [bytes.fromhex(key) for key in asked.block_keys]
        body = serving.batch_body(request.user, bytes(compat_id), bytes(scope_id), keys)
        response = StreamingHttpResponse(body.pieces(), content_type=body.content_type)
        response["Content-Length"] = str(body.length)
        return response


class LeaseListView(APIView):
    """POST leases (6.6)."""

    authentication_classes = [HolderAuthentication]

    @operation(
        LeaseRequest,
        {201: LeaseGrant, 404: PROBLEM, 422: PROBLEM, 429: PROBLEM},
        parameters=[location_header(201)],
    )
    def post(self, request):
        grant = leases.do_create_lease(request.user, LeaseRequest.from_json(request.data))
        return Response(
            grant.to_json(),
            status=status.HTTP_201_CREATED,
            headers={"Location": _node_url(request, f"leases/{grant.lease}")},
        )


class LeaseView(APIView):
    """Renew (PUT) or release (DELETE) a lease (6.6); only its holder's principal may."""

    authentication_classes = [HolderAuthentication]

    @operation(LeaseRenewal, {200: LeaseGrant, 404: PROBLEM, 422: PROBLEM, 429: PROBLEM})
    def put(self, request, lease: str):
        grant = leases.do_renew_lease(request.user, lease, LeaseRenewal.from_json(request.data))
        return Response(grant.to_json())

    @operation(responses={204: None, 404: PROBLEM})
    def delete(self, request, lease: str):
        leases.do_release_lease(request.user, lease)
        return Response(status=status.HTTP_204_NO_CONTENT)


class PrefetchView(APIView):
    """POST prefetch (6.5): 202 with the directive's status resource as Location."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(
        PrefetchDirective,
        {202: DirectiveStatusRecord, 403: PROBLEM, 409: PROBLEM, 422: PROBLEM},
        parameters=[location_header(202)],
    )
    def post(self, request):
        row = directives.do_accept_directive(PrefetchDirective.from_json(request.data))
        return Response(
            selectors.directive_status(row).to_json(),
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": _node_url(request, f"prefetch/{row.directive}")},
        )


class DirectiveView(APIView):
    """GET prefetch/{directive} (6.5): its state and the keys loaded so far."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(responses={200: DirectiveStatusRecord, 403: PROBLEM, 404: PROBLEM})
    def get(self, request, directive: uuid.UUID):
        row = Directive.objects.filter(instance=selectors.node_name(), directive=directive).first()
        if row is None:
            raise ProtocolError("kvsp-not-found", "no such directive")
        return Response(selectors.directive_status(row).to_json())


class StateView(APIView):
    """PUT state (6.3): the state the PC decided for this instance."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(StateChange, {200: StateAnswer, 403: PROBLEM, 409: PROBLEM})
    def put(self, request):
        change = StateChange.from_json(require_object(request.data))
        node = instance.do_apply_pc_state(selectors.node_name(), change.state)
        return Response(StateAnswer(state=node.state).to_json())


class GenerateView(APIView):
    """POST generate: a new session from a prompt (this implementation's request, not the
    spec's). 202 with the session's resource at the control plane as Location, where its
    checkpoints and output tokens appear (6.8)."""

    @operation(
        GenerateRequest,
        {202: SessionAdmitted, 403: PROBLEM, 409: PROBLEM, 503: PROBLEM},
        parameters=[location_header(202)],
    )
    def post(self, request):
        row = served_sessions.do_accept_generation(request.user, request.data)
        session_url = f"{settings.KVSP_CONTROL_URL}sessions/{row.session}"
        admitted = SessionAdmitted(
            session=str(row.session),
            epoch=row.epoch,
            state=row.state,
            session_url=session_url,
            output_url=f"{session_url}/output",
        )
        return Response(
            admitted.to_json(),
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": session_url},
        )


class ResumeView(APIView):
    """POST sessions/{session}/resume (6.8): the PC hands this instance a failed instance's
    session under a new epoch. 202 once admitted; the worker loads, recomputes and goes on."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(ResumeRequest, {202: SessionAdmitted, 403: PROBLEM, 409: PROBLEM, 503: PROBLEM})
    def post(self, request, session: str):
        row = served_sessions.do_accept_resume(session, request.data)
        admitted = SessionAdmitted(session=str(row.session), epoch=row.epoch, state=row.state)
        return Response(admitted.to_json(), status=status.HTTP_202_ACCEPTED)


class ReshardView(APIView):
    """POST reshard (6.9): a plan, answered 200 once its fetch ranges are loaded; a commit; or
    an abort (see ``workers.resharding``)."""

    permission_classes = [IsAuthenticated, IsController]

    # A plan is answered once its fetch ranges are loaded: 502 when a source failed, 503 when
    # deadline_ms passed first.
    @operation(
        "ReshardBody",
        {200: ReshardMoveAnswer, 403: PROBLEM, 409: PROBLEM, 502: PROBLEM, 503: PROBLEM},
    )
    def post(self, request):
        body = parse_reshard_body(request.data)
        if isinstance(body, ReshardPlan):
            move = resharding.do_prepare(body, request.data)
        else:
            move = resharding.do_decide(body, request.data)
        return Response(resharding.move_answer(move).to_json())
