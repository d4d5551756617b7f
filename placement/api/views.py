"""HTTP surface of the Placement Controller (DESIGN.md section 3)."""

from __future__ import annotations

from django.urls import reverse
from rest_framework.response import Response
from rest_framework.views import APIView

from kvsp.problems import ProtocolError
from kvsp.records import PlacementRequest
from placement import placements, resharding, services
from placement.models import Instance
from placement.selectors import instance_json, readable_reshard, readable_shard_map


def _require_controller(principal) -> None:
    if not principal.controller:
        raise ProtocolError("kvsp-forbidden", "only the Placement Controller's principal may")


class InstanceStatusView(APIView):
    """PUT an Instance Status Record (6.3); the answer carries the state the PC decided."""

    def put(self, request, name: str):
        answer = services.do_report_status(request.user, name, request.data)
        return Response(answer.to_json())


class InstanceStateView(APIView):
    """An operator's state change (6.3), carried out by the PC with PUT state on the instance."""

    def put(self, request, name: str):
        _require_controller(request.user)
        if not isinstance(request.data, dict):
            raise ProtocolError("kvsp-malformed-request", "the body must be a JSON object")
        instance = services.do_change_state(name, request.data.get("state"))
        return Response(instance_json(instance))


class InstanceListView(APIView):
    def get(self, request):
        return Response({"instances": [instance_json(i) for i in Instance.objects.all()]})


class InstanceDetailView(APIView):
    def get(self, request, name: str):
        instance = Instance.objects.filter(name=name).first()
        if instance is None:
            raise ProtocolError("kvsp-not-found", f"no instance {name!r} is registered")
        return Response(instance_json(instance))


class PlacementView(APIView):
    """Choose an instance for a request and prefetch its cache there (6.4, 6.5)."""

    def post(self, request):
        timer = placements.Timer()
        placement = PlacementRequest.from_json(request.data)
        return Response(placements.do_place(request.user, placement, timer=timer))


class ShardMapView(APIView):
    """A Shard Map (6.9): GET the authoritative version; PUT to create or set one. A map whose
    context is a scope the caller may not read answers like a map that does not exist; PUT
    and reshard are the Placement Controller's alone, and it reads every scope."""

    def get(self, request, map_id: str):
        row = readable_shard_map(request.user, map_id)
        if row is None:
            raise ProtocolError("kvsp-not-found", f"no shard map {map_id!r}")
        return Response(row.document())

    def put(self, request, map_id: str):
        _require_controller(request.user)
        row, created = resharding.do_put_shard_map(map_id, request.data)
        return Response(row.document(), status=201 if created else 200)


class ReshardView(APIView):
    """POST the next version's shards: the PC plans each member's move and runs it (6.9)."""

    def post(self, request, map_id: str):
        _require_controller(request.user)
        operation = resharding.do_start_reshard(map_id, request.data)
        location = request.build_absolute_uri(
            reverse("reshard-operation", args=[map_id, operation.to_version])
        )
        return Response(
            resharding.operation_json(operation), status=202, headers={"Location": location}
        )


class ReshardOperationView(APIView):
    """The latest attempt of the move to ``to_version``."""

    def get(self, request, map_id: str, to_version: int):
        operation = readable_reshard(request.user, map_id, to_version)
        if operation is None:
            raise ProtocolError("kvsp-not-found", f"no reshard of {map_id!r} to {to_version}")
        return Response(resharding.operation_json(operation))
