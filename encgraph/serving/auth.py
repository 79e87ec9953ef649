"""Optional bearer-token authentication of ``encgraph serve`` (``--api-key``, or ``ENCGRAPH_API_KEY``).

With a key, every request under ``/v1/`` must carry ``Authorization: Bearer <key>``; one without it, or with
another key, is answered 401 ``{"error": {..., "code": "invalid_api_key"}}`` with ``WWW-Authenticate: Bearer``,
before its body is read. ``/health`` and ``/metrics`` stay open (a load balancer's probe and a Prometheus scrape
carry no key) unless ``protect_all`` (``--api-key-everywhere``). The key is compared in constant time.

A pure ASGI middleware: it adds no task or body buffering to a request, and one comparison per request.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

__all__ = ["BearerAuth", "API_KEY_ENV"]

API_KEY_ENV = "ENCGRAPH_API_KEY"
"""The environment variable ``encgraph serve`` reads its key from when ``--api-key`` is not given (a key on the
command line shows in the process list; one in the environment does not)."""


class BearerAuth:
    """Wraps an ASGI ``app``: HTTP requests to protected paths need ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: Any, api_key: str, *, protect_all: bool = False) -> None:
        if not api_key or any(c.isspace() for c in api_key):
            raise ValueError("api_key: expected a non-empty key without spaces.")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.protect_all = protect_all

    def protects(self, path: str) -> bool:
        return self.protect_all or path.startswith("/v1/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.protects(scope["path"]):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await _unauthorized(send, "missing" if not given else "wrong")
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Any, how: str) -> None:
    message = (f"authorization: {'no' if how == 'missing' else 'a wrong'} API key; send the header "
               "'Authorization: Bearer <key>' with the key the server was started with (--api-key or "
               f"{API_KEY_ENV}).")
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "authorization",
                                 "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
