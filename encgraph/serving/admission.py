"""What ``encgraph serve`` lets into memory at once: request bodies being read and held, and images being decoded.

The server's memory beyond its idle footprint is what its requests hold: each body (up to ``max_body_bytes``,
held as bytes, then as the parsed strings), and each request's decoded images until its processor has made the
tower's inputs (Pillow's RGB pixels, 3 bytes each, plus the decoder's and the processor's working copies: the
default server's peak resident memory grew by 10.4-10.9 bytes per pixel of 3000 x 3000 and 6300 x 6300 RGB PNGs,
one request or two at once; :data:`BYTES_PER_PIXEL` counts 16). The embedded processors' outputs are small
(they resize to the tower's size; a checkpoint's processor adds its own output, at most its ``max_pixels`` per
image) and the runner's buffers are fixed at start-up, so two counters bound it:

- ``body_bytes``: bytes of bodies being read or held by requests in flight (:meth:`InFlight.take_bytes`, chunk by
  chunk as a body arrives);
- ``pixels``: decoded pixels of the requests between their decoding and their processor's end
  (:meth:`InFlight.take_pixels`, for the whole request, from the images' headers before any is decoded).

A request that would pass either limit is refused at once (503 with ``Retry-After``: the server is busy, not the
request wrong) and holds nothing; one that could never fit (more pixels than ``max_pixels`` alone) is refused
earlier by the per-request limit (413). What a request took is given back when it ends, whatever its outcome.
"""

from __future__ import annotations

import threading

import attrs

__all__ = ["InFlight", "InFlightLimits", "Refused", "BYTES_PER_PIXEL"]

BYTES_PER_PIXEL = 16
"""Host memory counted per decoded pixel between its decoding and its processor's end (10.4-10.9 measured, see the
module docs); the bound :meth:`InFlightLimits.bound_bytes` counts with."""


@attrs.frozen
class InFlightLimits:
    """``max_body_bytes``: request bodies held at once; ``max_pixels``: decoded pixels at once."""

    max_body_bytes: int = 512 * 2**20
    max_pixels: int = 200_000_000

    def bound_bytes(self) -> int:
        """The most memory the requests in flight hold together: each body twice (bytes, then parsed strings)
        and :data:`BYTES_PER_PIXEL` per decoded pixel."""
        return 2 * self.max_body_bytes + BYTES_PER_PIXEL * self.max_pixels


class Refused(Exception):
    """The server holds too much already: ``what`` (``"body_bytes"`` or ``"pixels"``), ``limit``, ``held``."""

    def __init__(self, what: str, wanted: int, held: int, limit: int) -> None:
        super().__init__(f"{wanted} {what.replace('_', ' ')} more would pass the server's limit of {limit} in "
                         f"flight ({held} held by other requests)")
        self.what, self.wanted, self.held, self.limit = what, wanted, held, limit


class InFlight:
    """The server's two counters; a :class:`Ticket` per request holds what that request took."""

    def __init__(self, limits: InFlightLimits = InFlightLimits()) -> None:
        self.limits = limits
        self._held = {"body_bytes": 0, "pixels": 0}
        self._lock = threading.Lock()  # taken on the event loop, given back there or from a request thread

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def ticket(self) -> Ticket:
        return Ticket(self)

    def _take(self, what: str, amount: int, limit: int) -> None:
        with self._lock:
            held = self._held[what]
            if held + amount > limit:
                raise Refused(what, amount, held, limit)
            self._held[what] = held + amount

    def _give(self, what: str, amount: int) -> None:
        with self._lock:
            self._held[what] -= amount


class Ticket:
    """What one request holds; :meth:`release` gives it all back (idempotent)."""

    def __init__(self, owner: InFlight) -> None:
        self._owner = owner
        self.body_bytes = 0
        self.pixels = 0

    def take_bytes(self, amount: int) -> None:
        self._owner._take("body_bytes", amount, self._owner.limits.max_body_bytes)
        self.body_bytes += amount

    def take_pixels(self, amount: int) -> None:
        self._owner._take("pixels", amount, self._owner.limits.max_pixels)
        self.pixels += amount

    def release_pixels(self) -> None:
        amount, self.pixels = self.pixels, 0
        if amount:
            self._owner._give("pixels", amount)

    def release(self) -> None:
        self.release_pixels()
        amount, self.body_bytes = self.body_bytes, 0
        if amount:
            self._owner._give("body_bytes", amount)
