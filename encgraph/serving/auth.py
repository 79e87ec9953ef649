"""Optional bearer-token authentication of ``encgraph serve`` (``--api-key``, or ``ENCGRAPH_API_KEY``).

With a key, every request under ``/v1/`` must carry ``Authorization: Bearer <key>``; one without it, or with
another key, is answered 401 ``{"error": {..., "code": "invalid_api_key"}}`` with ``WWW-Authenticate: Bearer``,
before its body is read. ``/health`` and ``/metrics`` stay open (a load balancer's probe and a Prometheus scrape
carry no key) unless ``protect_all`` (``--api-key-everywhere``). The key is compared in constant time.

A pure ASGI middleware: it adds no task or body buffering to a request, and one comparison per request.
"""

from __future__ import annotations

import hmac
from typing import Any

from encgraph.serving.protocol import ApiError

__all__ = ["BearerAuth", "API_KEY_ENV", "valid_key"]

API_KEY_ENV = "ENCGRAPH_API_KEY"
"""The environment variable ``encgraph serve`` reads its key from when ``--api-key`` is not given (a key on the
command line shows in the process list; one in the environment does not)."""


def valid_key(key: str) -> bool:
    """Whether ``key`` can be sent in an ``Authorization: Bearer`` header: non-empty, without spaces."""
    return bool(key) and not any(c.isspace() for c in key)


class BearerAuth:
    """Wraps an ASGI ``app``: HTTP requests to protected paths need ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: Any, api_key: str, *, protect_all: bool = False) -> None:
        if not valid_key(api_key):
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
                await _unauthorized("missing" if not given else "wrong")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unauthorized(how: str) -> Any:
    """The 401 answer (an ASGI app), in the documented error shape (:class:`ApiError`)."""
    message = (f"authorization: {'no' if how == 'missing' else 'a wrong'} API key; send the header "
               "'Authorization: Bearer <key>' with the key the server was started with (--api-key or "
               f"{API_KEY_ENV}).")
    return ApiError(401, "authorization", "invalid_api_key", message, {"WWW-Authenticate": "Bearer"}).response()
