"""HTTP surface of the Placement Controller (DESIGN.md section 3), and the Index Service's
``POST lookup``, whose estimates per target are the Placement Controller's to make."""

from __future__ import annotations

from django.conf import settings
from django.urls import reverse
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from common.api import require_object
from common.openapi import PROBLEM, operation
from common.permissions import IsController, IsControllerOrReadOnly
from index.selectors import lookup
from kvsp.problems import ProtocolError
from kvsp.records import (
    InstanceAnswer,
    InstancesAnswer,
    InstanceStatusRecord,
    LookupAnswer,
    LookupRequest,
    PlacementAnswer,
    PlacementRequest,
    ReshardOperationAnswer,
    ReshardRequest,
    ShardMap,
    StateAnswer,
    StateChange,
)
from placement import placements, resharding, services
from placement.models import Instance
from placement.selectors import (
    instance_json,
    lookup_estimates,
    readable_reshard,
    readable_shard_map,
)


# The index finds the replicas, the Placement Controller's cost model prices the targets. (The
# docstring is the operation's description in the OpenAPI document.)
class LookupView(APIView):
    """Prefix lookup (spec 6.2), with fetch and recompute estimates per target (6.4)."""

    @operation(LookupRequest, {200: LookupAnswer, 413: PROBLEM})
    def post(self, request):
        body = require_object(request.data)
        keys = body.get("block_keys")
        if isinstance(keys, list) and len(keys) > settings.KVSP_MAX_LOOKUP_KEYS:
            raise ProtocolError(
                "kvsp-payload-too-large",
                f"at most {settings.KVSP_MAX_LOOKUP_KEYS} block keys per lookup",
            )
        asked = LookupRequest.from_json(body, max_keys=settings.KVSP_MAX_LOOKUP_KEYS)
        return Response(lookup(request.user, asked, estimate=lookup_estimates))


class InstanceStatusView(APIView):
    """PUT an Instance Status Record (6.3); the answer carries the state the PC decided."""

    @operation(InstanceStatusRecord, {200: StateAnswer, 403: PROBLEM, 404: PROBLEM, 409: PROBLEM})
    def put(self, request, name: str):
        answer = services.do_report_status(request.user, name, request.data)
        return Response(answer.to_json())


class InstanceStateView(APIView):
    """An operator's state change (6.3), carried out by the PC with PUT state on the instance."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(StateChange, {200: InstanceAnswer, 403: PROBLEM, 404: PROBLEM, 409: PROBLEM})
    def put(self, request, name: str):
        change = StateChange.from_json(require_object(request.data))
        instance = services.do_change_state(name, change.state)
        return Response(instance_json(instance))


class InstanceListView(APIView):
    @operation(responses={200: InstancesAnswer})
    def get(self, request):
        return Response({"instances": [instance_json(i) for i in Instance.objects.all()]})


class InstanceDetailView(APIView):
    @operation(responses={200: InstanceAnswer, 404: PROBLEM})
    def get(self, request, name: str):
        instance = Instance.objects.filter(name=name).first()
        if instance is None:
            raise ProtocolError("kvsp-not-found", f"no instance {name!r} is registered")
        return Response(instance_json(instance))


class PlacementView(APIView):
    """Choose an instance for a request and prefetch its cache there (6.4, 6.5)."""

    @operation(PlacementRequest, {200: PlacementAnswer, 404: PROBLEM, 503: PROBLEM})
    def post(self, request):
        timer = placements.Timer()
        placement = PlacementRequest.from_json(request.data)
        return Response(placements.do_place(request.user, placement, timer=timer))


class ShardMapView(APIView):
    """A Shard Map (6.9): GET the authoritative version; PUT to create or set one. A map whose
    context is a scope the caller may not read answers like a map that does not exist; PUT
    and reshard are the Placement Controller's alone, and it reads every scope."""

    permission_classes = [IsAuthenticated, IsControllerOrReadOnly]

    @operation(responses={200: ShardMap, 404: PROBLEM})
    def get(self, request, map_id: str):
        row = readable_shard_map(request.user, map_id)
        if row is None:
            raise ProtocolError("kvsp-not-found", f"no shard map {map_id!r}")
        return Response(row.document())

    @operation(ShardMap, {200: ShardMap, 201: ShardMap, 403: PROBLEM, 409: PROBLEM})
    def put(self, request, map_id: str):
        row, created = resharding.do_put_shard_map(map_id, request.data)
        return Response(row.document(), status=201 if created else 200)


class ReshardView(APIView):
    """POST the next version's shards: the PC plans each member's move and runs it (6.9)."""

    permission_classes = [IsAuthenticated, IsController]

    @operation(
        ReshardRequest, {202: ReshardOperationAnswer, 403: PROBLEM, 404: PROBLEM, 409: PROBLEM}
    )
    def post(self, request, map_id: str):
        operation = resharding.do_start_reshard(map_id, request.data)
        location = request.build_absolute_uri(
            reverse("reshard-operation", args=[map_id, operation.to_version])
        )
        return Response(
            resharding.operation_json(operation), status=202, headers={"Location": location}
        )


class ReshardOperationView(APIView):
    """The latest attempt of the move to ``to_version``."""

    @operation(responses={200: ReshardOperationAnswer, 404: PROBLEM})
    def get(self, request, map_id: str, to_version: int):
        operation = readable_reshard(request.user, map_id, to_version)
        if operation is None:
            raise ProtocolError("kvsp-not-found", f"no reshard of {map_id!r} to {to_version}")
        return Response(resharding.operation_json(operation))
