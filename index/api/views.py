"""HTTP surface of the Index Service (DESIGN.md section 3): validate, call a service, answer.

``POST lookup`` answers with the Placement Controller's estimates per target as well, so its
view is placement's (``placement.api.views.LookupView``), which passes them into the index's
lookup."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from common.api import require_object
from common.openapi import PROBLEM, operation
from index import delegation, selectors, services
from index.scopekeys import open_scope_key
from kvsp.problems import ProtocolError
from kvsp.records import (
    ReplicaBatchAnswer,
    ReplicaRecord,
    Replicas,
    ScopeKeyAnswer,
    TokenGrant,
    TokenIntrospection,
    TokenIntrospectionRequest,
    TokenRequest,
)


def _batch_items(data, member: str, item: str) -> list:
    """The items of a batch body ``{member: [item, ...]}``; the body is refused whole when it
    is not one, or has more items than KVSP_MAX_BATCH_RECORDS."""
    items = require_object(data).get(member)
    if not isinstance(items, list):
        raise ProtocolError(
            "kvsp-malformed-request", f'the body must be {{"{member}": [{item}, ...]}}'
        )
    if len(items) > settings.KVSP_MAX_BATCH_RECORDS:
        raise ProtocolError(
            "kvsp-payload-too-large",
            f"at most {settings.KVSP_MAX_BATCH_RECORDS} {member} per batch",
        )
    return items


class ReplicaView(APIView):
    """One block's replicas: publish or refresh (PUT), withdraw (DELETE), list (GET); spec 6.1."""

    @operation(ReplicaRecord, {200: ReplicaRecord, 201: ReplicaRecord, 403: PROBLEM, 422: PROBLEM})
    def put(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        record = ReplicaRecord.from_json(require_object(request.data))
        for name, in_path, in_body in (
            ("compat_id", compat_id, record.compat_id_bytes),
            ("scope_id", scope_id, record.scope_id_bytes),
            ("block_key", block_key, record.block_key_bytes),
        ):
            if in_path != in_body:
                raise ProtocolError(
                    "kvsp-malformed-request", f"{name} in the body differs from the path"
                )
        published = services.do_publish_replica(request.user, record)
        return Response(
            published.to_json(),
            status=status.HTTP_201_CREATED if published.created else status.HTTP_200_OK,
        )

    @operation(
        responses={204: None, 400: PROBLEM, 403: PROBLEM, 404: PROBLEM},
        parameters=[OpenApiParameter("holder", str, required=True)],
    )
    def delete(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        holder = request.query_params.get("holder")
        if not holder:
            raise ProtocolError("kvsp-malformed-request", "the query parameter holder is required")
        services.do_withdraw_replica(request.user, compat_id, scope_id, block_key, holder)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @operation(responses={200: Replicas, 404: PROBLEM})
    def get(self, request, compat_id: bytes, scope_id: bytes, block_key: bytes):
        found = selectors.replica_rows_by_key(request.user, compat_id, scope_id, [block_key])
        if block_key not in found:
            raise ProtocolError("kvsp-not-found", "no unexpired replica of this block")
        replicas = [row.fragment() for row in found[block_key]]
        return Response({"block_key": block_key.hex(), "replicas": replicas})


class ReplicaBatchView(APIView):
    """Batch publication (DESIGN.md section 3, an extension of 6.1): many Replica Records in
    one request, each judged as its single PUT would be, every outcome answered in order."""

    @operation("ReplicaBatch", {200: ReplicaBatchAnswer, 400: PROBLEM, 413: PROBLEM})
    def post(self, request):
        # A batch whose every record is valid (what holders send) is decoded from its octets
        # in one pass; any other is judged item by item, each told what is wrong with it.
        records = ReplicaRecord.batch_from_body(request.body, "records")
        if records is not None and len(records) > settings.KVSP_MAX_BATCH_RECORDS:
            records = None
        if records is None:
            records = _batch_items(request.data, "records", "Replica Record")
        outcomes = services.do_publish_batch(request.user, records)
        return Response({"results": [outcome.to_json() for outcome in outcomes]})


class ReplicaWithdrawalBatchView(APIView):
    """Batch withdrawal (an extension of 6.1, like batch publication): many replicas, each
    named by the members that name it in its record, each judged as its single DELETE."""

    @operation("ReplicaWithdrawalBatch", {200: ReplicaBatchAnswer, 400: PROBLEM, 413: PROBLEM})
    def post(self, request):
        replicas = _batch_items(
            request.data, "replicas", '{"compat_id", "scope_id", "block_key", "holder"}'
        )
        outcomes = services.do_withdraw_batch(request.user, replicas)
        return Response({"results": [outcome.to_json() for outcome in outcomes]})


class CompatView(APIView):
    """Register (PUT) or read (GET) a Compatibility Descriptor under its computed id (4.1)."""

    @operation(
        "CompatibilityDescriptor",
        {200: "CompatibilityDescriptor", 201: "CompatibilityDescriptor", 422: PROBLEM},
    )
    def put(self, request, compat_id: bytes):
        row, created = services.do_register_descriptor(request.data, compat_id.hex())
        return Response(
            row.descriptor, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )

    @operation(responses={200: "CompatibilityDescriptor", 404: PROBLEM})
    def get(self, request, compat_id: bytes):
        row = selectors.descriptor(compat_id)
        if row is None:
            raise ProtocolError("kvsp-not-found", "no descriptor registered under this id")
        return Response(row.descriptor)


class ScopeKeyView(APIView):
    """The scope key, for principals of the scope: the spec's "means outside this document"."""

    @operation(responses={200: ScopeKeyAnswer, 404: PROBLEM})
    def get(self, request, scope_id: bytes):
        scope = selectors.scope_for(request.user, scope_id)
        if scope is None:
            raise ProtocolError("kvsp-not-found", "no such scope")
        key = open_scope_key(scope.scope_id, scope.key_ciphertext)
        answer = ScopeKeyAnswer(scope_id=scope_id.hex(), name=scope.name, scope_key=key.hex())
        return Response(answer.to_json(), headers={"Cache-Control": "no-store"})


# A token answer is never stored by a cache on the way (as RFC 6749 5.1 asks of token answers).
_NO_STORE = {"Cache-Control": "no-store"}


class TokenView(APIView):
    """POST tokens (DESIGN.md section 6): a delegated token for one scope at one holder."""

    @operation(TokenRequest, {200: TokenGrant, 403: PROBLEM, 404: PROBLEM, 422: PROBLEM})
    def post(self, request):
        grant = delegation.do_issue_token(request.user, TokenRequest.from_json(request.data))
        return Response(grant.to_json(), headers=_NO_STORE)


class TokenIntrospectionView(APIView):
    """POST tokens/introspect (DESIGN.md section 6, RFC 7662 in shape), for holders and the
    Placement Controller."""

    @operation(TokenIntrospectionRequest, {200: TokenIntrospection, 403: PROBLEM, 422: PROBLEM})
    def post(self, request):
        asked = TokenIntrospectionRequest.from_json(request.data)
        answer = delegation.introspect(request.user, asked.token)
        return Response(answer.to_json(), headers=_NO_STORE)
