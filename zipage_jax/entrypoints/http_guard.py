"""What stands between a connection and the routes, so that no client can hold the server or its memory:

- ``guarded_protocol``: uvicorn's HTTP protocol with a deadline on a request's headers (from the connection's start
  or its previous response), so half-open connections that never finish a request are closed;
- ``RequestGuard`` (ASGI): the API key checked before any body is read (a 401 comes before a 400), the body read
  whole within the same deadline (408 past it) and a size cap (413, the rest drained unread), then replayed to the
  app; and the one place an unexpected exception is logged: one traceback, a 500 in OpenAI's error shape.
"""

import asyncio
import json
import logging
import secrets

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)


def guarded_protocol(read_timeout: float, base: type = AutoHTTPProtocol) -> type:
    """uvicorn's protocol (httptools where installed, else h11) whose connections close when a request's headers
    are not complete ``read_timeout`` seconds after the connection opened or its previous response ended (an idle
    keep-alive connection closes sooner, at uvicorn's keep-alive timeout)."""

    class Guarded(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._headers_due: asyncio.TimerHandle | None = None
            app = self.app

            async def headers_complete(scope, receive, send):  # uvicorn calls the app once it has the headers
                self._disarm()
                await app(scope, receive, send)

            self.app = headers_complete

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            self._arm()  # first: a pipelined request's app starts inside, and disarms it
            super().on_response_complete()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._headers_due = self.loop.call_later(read_timeout, self._expire)

        def _disarm(self):
            if self._headers_due is not None:
                self._headers_due.cancel()
                self._headers_due = None

        def _expire(self):
            if not self.transport.is_closing():
                self.transport.close()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


class RequestGuard:
    """Pure ASGI (streams and disconnects pass through untouched). ``api_key``: required as ``Authorization:
    Bearer`` on paths under ``/v1`` (as vLLM); ``max_body_bytes``: the largest body read; ``read_timeout``: seconds
    the whole body may take to arrive."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, read_timeout: float):
        self.app, self.max_body_bytes, self.read_timeout = app, max_body_bytes, read_timeout
        self.expected = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if not self._authorized(scope):
                return await respond(send, 401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                     "invalid_request_error", "invalid_api_key")
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._read_body(receive, send)
                if receive is None:
                    return
            await self.app(scope, receive, tracking_send)
        except Exception:  # the routes answer every error they expect: this is a bug, logged once
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await respond(send, 500, "internal server error", "internal_error")

    def _authorized(self, scope) -> bool:
        if self.expected is None or not scope["path"].startswith("/v1"):
            return True
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.expected)

    async def _read_body(self, receive, send):
        """The body, read within the deadline and the cap, as a ``receive`` that replays it (then the real one:
        the app still hears a disconnect); None once answered (too slow, too large) or the client left."""
        chunks, size, too_large = [], 0, False
        try:
            async with asyncio.timeout(self.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body = message.get("body", b"")
                    size += len(body)
                    too_large = too_large or size > self.max_body_bytes
                    if not too_large:
                        chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await respond(send, 408, f"the request body did not arrive within {self.read_timeout:g} s",
                          "invalid_request_error", "request_timeout", close=True)
            return None
        if too_large:
            await respond(send, 413, f"the request body exceeds this server's limit of {self.max_body_bytes} bytes "
                                     "(--max-body-bytes)", "invalid_request_error", "request_too_large")
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return replay


async def respond(send, status: int, message: str, type: str, code: str | None = None, close: bool = False):
    headers = [(b"content-type", b"application/json")] + ([(b"connection", b"close")] if close else [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
