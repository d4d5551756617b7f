"""HTTP surface of sessions (spec 6.8): checkpoints, the session, and the output stream."""

from __future__ import annotations

import time

import orjson
from django.http import StreamingHttpResponse
from rest_framework.response import Response
from rest_framework.views import APIView

from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from sessions import services
from sessions.models import Session

STREAM_POLL_S = 0.05
STREAM_IDLE_LIMIT_S = 300


class CheckpointView(APIView):
    def put(self, request, session: str):
        answer = services.do_checkpoint(request.user, session, request.data)
        return Response(answer.to_json(), status=201 if answer.created else 200)


class SessionView(APIView):
    def get(self, request, session: str):
        key = services.parse_session_id(session)
        row = Session.objects.select_related("instance").filter(session=key).first()
        if row is None or not (
            request.user.controller or bytes(row.scope_id) in request.user.scope_ids
        ):
            raise ProtocolError("kvsp-not-found", "no such session")
        return Response(services.session_json(row))


class OutputView(APIView):
    """POST tokens (the serving instance); GET them, or stream them as server-sent events."""

    def post(self, request, session: str):
        return Response(services.do_post_output(request.user, session, request.data))

    def get(self, request, session: str):
        after = _int_param(request.query_params.get("after", "-1"), "after")
        if "text/event-stream" in request.headers.get("Accept", ""):
            last_id = request.headers.get("Last-Event-ID")
            if last_id is not None:
                after = max(after, _int_param(last_id, "Last-Event-ID"))
            # Check access and existence now, so that an error is a problem, not a stream.
            services.output_of(request.user, session, after=after)
            return _event_stream(request.user, session, after)
        return Response(services.output_of(request.user, session, after=after))

    def perform_content_negotiation(self, request, force=False):
        # The event stream is rendered by hand; let DRF negotiate only the JSON answers.
        if "text/event-stream" in request.headers.get("Accept", ""):
            return self.get_renderers()[0], "application/kvsp+json"
        return super().perform_content_negotiation(request, force)


def _int_param(value: str, name: str) -> int:
    return parse_decimal(value, name, minimum=-1)


def _event_stream(principal, session: str, after: int) -> StreamingHttpResponse:
    def events():
        last, idle_since = after, time.monotonic()
        while True:
            answer = services.output_of(principal, session, after=last)
            for token in answer["tokens"]:
                last = token["index"]
                yield f"id: {last}\nevent: token\ndata: {orjson.dumps(token).decode()}\n\n"
                idle_since = time.monotonic()
            if answer["complete"]:
                yield "event: complete\ndata: {}\n\n"
                return
            if time.monotonic() - idle_since > STREAM_IDLE_LIMIT_S:
                return
            time.sleep(STREAM_POLL_S)

    response = StreamingHttpResponse(events(), content_type="text/event-stream")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response
