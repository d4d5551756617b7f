"""Django's WSGI application served on an event loop (gunicorn's ASGI worker, ``-k asgi``).

Every request is handled in a fixed pool of threads, exactly as gunicorn's gthread worker handles
it, so that each thread keeps its database connection from one request to the next. Only the
body of a ``LoopStreamingResponse`` (the output event streams, ``sessions/api/views.py``) is
sent from the event loop itself: a stream holds no thread while it waits, and the server notices
at once when its client leaves (the worker tells the application ``http.disconnect``), so the
stream's iterator is closed there and then.

Django's own ASGI handler is not used for the rest because it runs the synchronous part of each
request in a thread made for that request: the database connection of the thread goes with it,
so every request would open one (BENCHMARKS.md, "Output streams", has the figures).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from django.http import StreamingHttpResponse

log = logging.getLogger(__name__)

# A request body larger than this is spooled to a file while it is read.
_SPOOL_OCTETS = 256 * 1024


class LoopStreamingResponse(StreamingHttpResponse):
    """A streaming response whose body an async iterator (an async generator) produces.

    Under ``WsgiOnLoop`` the body is sent from the event loop and the generator is closed
    however the response ends, the client leaving included; ``on_close`` is called then, in a
    thread, even when the body never started. Under a plain WSGI server each
    response drives its generator on an event loop of its own, holding the thread for as long
    as the body lasts (Django would otherwise gather the whole body before sending any of it).
    """

    def __init__(self, events, *, on_close=None, **kwargs):
        super().__init__(events, **kwargs)
        self.events = events
        self._on_close = on_close

    def close(self):
        # Called once the response is over, however it ended, even if its body never started.
        try:
            if self._on_close is not None:
                self._on_close()
        finally:
            super().close()

    def __iter__(self):
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    part = loop.run_until_complete(anext(self.events))
                except StopAsyncIteration:
                    return
                yield self.make_bytes(part)
        finally:
            loop.run_until_complete(self.events.aclose())
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()


class WsgiOnLoop:
    """The ASGI application: ``wsgi_application`` in ``threads`` threads, and the bodies of
    ``LoopStreamingResponse``s on the loop. The requests that ``lean.route(scope)`` takes (a
    node's block GETs, ``workers.blockpath``) are answered by ``lean.answer`` in the same
    threads, without Django's handler."""

    def __init__(self, wsgi_application, *, threads: int, body_limit: int, lean=None):
        self.wsgi_application = wsgi_application
        self.lean = lean
        self.threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvsp-http")
        # Octets of a request body read at most: one more than any parser accepts, so that a
        # larger body is still refused by the application (413) without being read whole.
        self.body_limit = body_limit + 1

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                # The threads stay: streams still open are closed after this, in them.
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope, receive, send) -> None:
        if self.lean is not None:
            ids = self.lean.route(scope)
            if ids is not None:
                await self._lean(scope, receive, send, ids)
                return
        loop = asyncio.get_running_loop()
        body = tempfile.SpooledTemporaryFile(max_size=_SPOOL_OCTETS)
        try:
            received = await self._read_body(receive, body)
            if received is None:
                return  # the client left before its request was whole
            body.seek(0)
            environ = _environ(scope, body, received)
            status, headers, content, streaming = await loop.run_in_executor(
                self.threads, self._respond, environ
            )
        finally:
            body.close()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if isinstance(content, Pieces) and scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            await loop.run_in_executor(self.threads, content.close)
        elif isinstance(content, Pieces):
            await self._send_pieces(content, send)
        elif streaming is None:
            await send({"type": "http.response.body", "body": content})
        elif scope["method"] == "HEAD":  # the head is the whole answer
            await send({"type": "http.response.body", "body": b""})
            await streaming.events.aclose()
            await loop.run_in_executor(self.threads, streaming.close)
        else:
            await self._stream(streaming, receive, send)

    async def _lean(self, scope, receive, send, ids) -> None:
        while True:  # a GET's body, if any, is not the answer's business
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not message.get("more_body", False):
                break
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self.threads, self.lean.answer, scope, ids)
        start = {"type": "http.response.start", "status": answer.status, "headers": answer.fields}
        await send(start)
        rest = None if answer.rest is None else Pieces(answer.rest.pieces(), answer.rest.close)
        await send({"type": "http.response.body", "body": answer.body, "more_body": bool(rest)})
        if rest is not None:
            await self._send_pieces(rest, send)

    async def _send_pieces(self, pieces: Pieces, send) -> None:
        """Send a body made in the threads a piece at a time, each piece read there as the
        previous one goes out; the source is closed however the sending ends."""
        loop = asyncio.get_running_loop()
        try:
            while (piece := await loop.run_in_executor(self.threads, pieces.next)) is not None:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await loop.run_in_executor(self.threads, pieces.close)

    async def _read_body(self, receive, body) -> int | None:
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if received < self.body_limit:
                chunk = chunk[: self.body_limit - received]
                body.write(chunk)
                received += len(chunk)
            if not message.get("more_body", False):
                return received
            if received >= self.body_limit:
                # The rest is never read: the worker closes the connection after the answer.
                return received

    def _respond(self, environ) -> tuple:
        """In a thread of the pool: the whole answer, or the head of a loop stream."""
        head = []

        def start_response(status, response_headers, exc_info=None):
            head[:] = [status, response_headers]

        response = self.wsgi_application(environ, start_response)
        streaming = response if isinstance(response, LoopStreamingResponse) else None
        content = b""
        if streaming is None and getattr(response, "streaming", False):
            # A body that may be large (a block from its file): sent a piece at a time.
            content = Pieces(iter(response), response.close)
        elif streaming is None:
            try:
                content = b"".join(response)
            finally:
                if hasattr(response, "close"):
                    response.close()
        status, response_headers = head
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in response_headers
        ]
        return int(status.split(" ", 1)[0]), headers, content, streaming

    async def _stream(self, response: LoopStreamingResponse, receive, send) -> None:
        async def pump():
            async for part in response.events:
                await send(
                    {
                        "type": "http.response.body",
                        "body": response.make_bytes(part),
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b""})

        async def client_left():
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(pump())
        leaving = asyncio.ensure_future(client_left())
        try:
            await asyncio.wait({sending, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, leaving):
                task.cancel()
            await asyncio.gather(sending, leaving, return_exceptions=True)
            # The generator is closed whether it ended, failed or was left mid-frame.
            try:
                await response.events.aclose()
            except Exception:
                log.exception("closing an event stream failed")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.threads, response.close)
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            log.warning("an event stream failed: %r", sending.exception())


class Pieces:
    """The pieces of a body, each made by ``next`` in a request thread, and what closes their
    source."""

    def __init__(self, pieces, close):
        self._pieces = pieces
        self._close = close

    def next(self) -> bytes | None:
        for piece in self._pieces:
            if piece:
                return bytes(piece)
        return None

    def close(self) -> None:
        self._close()

    def __bool__(self) -> bool:
        return True


def _environ(scope, body, length: int) -> dict:
    """The WSGI environ of an ASGI HTTP request (PEP 3333), its body read into ``body``."""
    script_name = scope.get("root_path", "").encode("utf-8").decode("latin-1")
    path_info = scope["path"].encode("utf-8").decode("latin-1")
    if script_name and path_info.startswith(script_name):
        path_info = path_info[len(script_name) :]
    server = scope.get("server") or ("localhost", 80)
    environ = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": script_name,
        "PATH_INFO": path_info,
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] if server[1] is not None else 80),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if scope.get("client"):
        environ["REMOTE_ADDR"] = str(scope["client"][0])
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        if name in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            key = name
        else:
            key = f"HTTP_{name}"
        value = raw_value.decode("latin-1")
        if key in environ:
            value = environ[key] + ("; " if key == "HTTP_COOKIE" else ",") + value
        environ[key] = value
    # A chunked body has no Content-Length; what was read is its length.
    if "CONTENT_LENGTH" not in environ and length:
        environ["CONTENT_LENGTH"] = str(length)
    return environ
