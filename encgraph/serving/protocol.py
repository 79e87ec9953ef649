"""The embeddings request and its answers, for :mod:`encgraph.serving.app`: the request's limits
(:class:`ServerLimits`), the body read within them, its JSON parsed (:class:`EmbeddingRequest`), its pixels counted
from the images' headers, the JSON answer, and the error every refusal becomes (:class:`ApiError`, the documented
``{"error": {"message", "type", "param", "code"}}`` shape)."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError, field_validator

from encgraph.errors import ConfigError
from encgraph.serving.admission import InFlightLimits, Refused, Ticket
from encgraph.serving.images import ImageError, ImageLimits, image_size

__all__ = ["ServerLimits", "EmbeddingRequest", "ApiError", "parse_request", "read_body", "take", "count_pixels",
           "answer", "retry_headers"]


@attrs.frozen
class ServerLimits:
    """What one request may hold: ``max_images`` images, ``max_body_bytes`` of JSON, ``max_request_pixels``
    pixels over its images, per image ``image`` limits; what all requests in flight may hold together,
    ``in_flight`` (:mod:`encgraph.serving.admission`); ``retry_after_s``: the ``Retry-After`` of a 503."""

    max_images: int = 32
    max_body_bytes: int = 64 * 2**20
    image: ImageLimits = ImageLimits()
    retry_after_s: int = 1
    max_request_pixels: int = 100_000_000
    in_flight: InFlightLimits = InFlightLimits()

    def __attrs_post_init__(self) -> None:
        # A request that could never be let in must be refused as too large (413), not as busy (503) forever.
        if self.max_request_pixels > self.in_flight.max_pixels:
            raise ConfigError(f"max_request_pixels: expected at most the pixels in flight "
                              f"({self.in_flight.max_pixels}), got {self.max_request_pixels}.")
        if self.max_body_bytes > self.in_flight.max_body_bytes:
            raise ConfigError(f"max_body_bytes: expected at most the body bytes in flight "
                              f"({self.in_flight.max_body_bytes}), got {self.max_body_bytes}.")


class EmbeddingRequest(BaseModel):
    """The request body (unknown fields are refused: a misspelt option must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    input: list[StrictStr]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    return_tokens: StrictBool = False
    user: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_image(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ApiError(Exception):
    def __init__(self, status: int, param: str | None, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    @classmethod
    def of_image(cls, exc: ImageError) -> ApiError:
        return cls(exc.status, exc.param, exc.code, str(exc))

    def response(self) -> JSONResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _param(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def parse_request(body: bytes) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        # An unknown field first, whatever order pydantic lists its errors in: a misspelt "inputs" also leaves
        # "input" missing, and only the unknown name tells the client what to fix.
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        if err["type"] == "json_invalid":
            raise ApiError(400, "body", "invalid_json", f"body: not valid JSON ({err['msg']}).") from None
        param = _param(err["loc"])
        hint = {"input": "expected a base64 image or data URI string, or a list of them"}.get(param)
        message = f"{param}: {hint} ({err['msg']})." if hint else f"{param}: {err['msg']}."
        raise ApiError(422, param, err["type"], message) from None


async def read_body(request: Request, limits: ServerLimits, ticket: Ticket) -> bytes:
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body", "body_too_large", f"body: {declared} bytes is over the server's limit of {limit}.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body", "body_too_large", f"body: over the server's limit of {limit} bytes.")
        take(ticket.take_bytes, len(chunk), limits)
        chunks.append(chunk)
    return b"".join(chunks)


def take(take: Any, amount: int, limits: ServerLimits) -> None:
    try:
        take(amount)
    except Refused as exc:
        flag = {"pixels": "--max-pixels-in-flight", "body_bytes": "--max-body-bytes-in-flight"}[exc.what]
        raise ApiError(503, None, "overloaded", f"the server is busy: {exc} ({flag}); retry later.",
                       retry_headers(limits)) from None


def count_pixels(images: Sequence[str], limits: ServerLimits) -> int:
    """The request's pixels, from its images' headers (no pixel decoded); 413 over ``max_request_pixels``."""
    try:
        total = sum(w * h for w, h in (image_size(text, i, limits.image) for i, text in enumerate(images)))
    except ImageError as exc:
        raise ApiError.of_image(exc) from None
    if total > limits.max_request_pixels:
        raise ApiError(413, "input", "request_too_large",
                       f"input: the images have {total} pixels together, over the server's limit of "
                       f"{limits.max_request_pixels} per request (--max-request-pixels); split the request or send "
                       "smaller images.")
    return total


def _encode(array: Any, fmt: str) -> Any:
    """``array`` as its ``encoding_format`` asks: a string of its little-endian float32 bytes in base64, or the
    float32 array itself (1-D, or 2-D as a list of rows: trailing dimensions flattened into each row), which orjson
    writes as each value's shortest text that reads back to the same float32, each a JSON float (``10.0``, never
    ``10``; ``-0.0`` keeps its sign). Raises ValueError on NaN or infinity in ``float``, which JSON has no number
    for, as ``json.dumps(allow_nan=False)`` does (orjson would write ``null``)."""
    values = np.asarray(array, dtype=np.float32)
    if fmt == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    if not np.isfinite(values).all():
        raise ValueError("embedding: NaN or infinite values have no JSON number (encoding_format='base64' carries "
                         "them).")
    if values.ndim > 2:
        values = values.reshape(values.shape[0], math.prod(values.shape[1:]))
    return np.ascontiguousarray(values)


def answer(model: Any, results: list[Any], request: EmbeddingRequest) -> Response:
    """The request's JSON answer (the module docs' shape), written by orjson: the embeddings' numbers are almost all
    of it, and ``json.dumps`` of their float64 lists took 24x longer with the GIL held (0.67 against 0.028 ms for one
    1,152-wide embedding on the development CPU; an answer with a SigLIP image's 729 x 1,152 tokens takes 22 ms,
    7 in base64)."""
    data = []
    for i, (pooled, tokens) in enumerate(model.embeddings(results, request.return_tokens)):
        entry: dict[str, Any] = {"object": "embedding", "index": i,
                                 "embedding": _encode(pooled, request.encoding_format)}
        if tokens is not None:
            entry["tokens"] = _encode(tokens, request.encoding_format)
            entry["tokens_shape"] = [int(n) for n in tokens.shape]
        data.append(entry)
    used = int(model.token_count(results))
    body = {"object": "list", "model": model.name, "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used}}
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


def retry_headers(limits: ServerLimits) -> dict[str, str]:
    return {"Retry-After": str(limits.retry_after_s)}
