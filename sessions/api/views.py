"""HTTP surface of sessions (spec 6.8): checkpoints, the session, and the output stream."""

from __future__ import annotations

import asyncio
import functools
import time

import orjson
from django.conf import settings
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import APIView

from common.asgibridge import LoopStreamingResponse
from common.openapi import PROBLEM, operation
from common.permissions import may_read_scope
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import (
    CheckpointAnswer,
    DeliveredOutput,
    OutputAnswer,
    SessionAnswer,
    SessionCheckpoint,
)
from sessions import services, streams
from sessions.models import Session

# A stream with no token for this long ends (the client may ask again with Last-Event-ID).
STREAM_IDLE_LIMIT_S = 300


class CheckpointView(APIView):
    @operation(
        SessionCheckpoint,
        {200: CheckpointAnswer, 201: CheckpointAnswer, 403: PROBLEM, 409: PROBLEM},
    )
    def put(self, request, session: str):
        answer = services.do_checkpoint(request.user, session, request.data)
        return Response(answer.answer().to_json(), status=201 if answer.created else 200)


class SessionView(APIView):
    @operation(responses={200: SessionAnswer, 404: PROBLEM})
    def get(self, request, session: str):
        key = services.parse_session_id(session)
        row = Session.objects.select_related("instance").filter(session=key).first()
        if row is None or not may_read_scope(request.user, row.scope_id):
            raise ProtocolError("kvsp-not-found", "no such session")
        return Response(services.session_json(row))


class OutputView(APIView):
    """POST tokens (the serving instance); GET them, or stream them as server-sent events."""

    @operation("OutputPost", {200: OutputAnswer, 403: PROBLEM, 404: PROBLEM, 409: PROBLEM})
    def post(self, request, session: str):
        return Response(services.do_post_output(request.user, session, request.data).to_json())

    @operation(responses={200: DeliveredOutput, 404: PROBLEM})
    def get(self, request, session: str):
        after = _int_param(request.query_params.get("after", "-1"), "after")
        if "text/event-stream" in request.headers.get("Accept", ""):
            last_id = request.headers.get("Last-Event-ID")
            if last_id is not None:
                after = max(after, _int_param(last_id, "Last-Event-ID"))
            # Check access and existence now, so that an error is a problem, not a stream.
            answer = services.output_of(request.user, session, after=after)
            row = streams.do_open_stream(request.user, services.parse_session_id(session))
            if row is None:
                raise exceptions.Throttled(
                    wait=settings.KVSP_STREAM_HEARTBEAT_S,
                    detail=f"at most {settings.KVSP_STREAMS_PER_PRINCIPAL} output streams at "
                    "once per principal",
                )
            response = LoopStreamingResponse(
                _events(session, after, answer, row),
                on_close=functools.partial(streams.do_close_stream, row),
                content_type="text/event-stream",
            )
            response["Cache-Control"] = "no-store"
            response["X-Accel-Buffering"] = "no"
            return response
        return Response(services.output_of(request.user, session, after=after))

    def perform_content_negotiation(self, request, force=False):
        # The event stream is rendered by hand; let DRF negotiate only the JSON answers.
        if "text/event-stream" in request.headers.get("Accept", ""):
            return self.get_renderers()[0], "application/kvsp+json"
        return super().perform_content_negotiation(request, force)


def _int_param(value: str, name: str) -> int:
    return parse_decimal(value, name, minimum=-1)


async def _events(session: str, after: int, answer: dict, row: int):
    """The frames of one stream: its tokens as they are delivered, ``complete`` at the end, and
    a comment at least every ``KVSP_STREAM_HEARTBEAT_S``; over after ``STREAM_IDLE_LIMIT_S``
    without a token."""
    key = services.parse_session_id(session)
    heartbeat = settings.KVSP_STREAM_HEARTBEAT_S
    tokens, complete = answer["tokens"], answer["complete"]
    last = tokens[-1]["index"] if tokens else after
    watcher = streams.watcher()
    subscription = watcher.subscribe(key, last, row)
    try:
        idle_since = written_at = time.monotonic()
        while True:
            for token in tokens:
                data = orjson.dumps(token).decode()
                yield f"id: {token['index']}\nevent: token\ndata: {data}\n\n"
                idle_since = written_at = time.monotonic()
            if complete:
                yield "event: complete\ndata: {}\n\n"
                return
            now = time.monotonic()
            if subscription.gone or now - idle_since > STREAM_IDLE_LIMIT_S:
                return
            try:
                await asyncio.wait_for(
                    subscription.ready.wait(), timeout=max(written_at + heartbeat - now, 0)
                )
            except TimeoutError:
                tokens = []
                yield ": keepalive\n\n"
                written_at = time.monotonic()
                continue
            tokens, complete = subscription.take(), subscription.complete
    finally:
        watcher.unsubscribe(key, subscription, row)
