"""How long a call of the batching front waits for more requests (:class:`WaitPolicy`).

``max_wait_ms`` is an upper bound; with ``adaptive_wait`` (the default) a call waits less, by what it can know:

- **On a CUDA target** (a runner or graphed module on a GPU) a call waits only while the device is still busy
  with the calls launched before it: the front records a CUDA event after each call and polls it (every
  :data:`IDLE_POLL_S`, never syncing). A request that finds the device idle is launched at once with what is
  already queued; one that finds it busy waits until the device goes idle, at most ``max_wait_ms`` after it
  arrived, gathering the requests that come meanwhile: they could not have started sooner anyway. So a lone
  client never pays the wait, and a server whose device is not its bottleneck (its preprocessing is) adds none:
  measured on an H200 behind ``encgraph serve`` at 32 clients (tree c22624d), a fixed 2 ms wait gave Qwen2.5-VL a
  P99 of 208 ms against 178 ms for one call per request, at the same images/s (223 and 220); with this rule (tree
  565e09b, the next run, another host) 190 ms against 186, at 252 and 237 images/s.
- **Elsewhere** (the CPU, where a call returns when its work is done, or a callable target) a call waits the
  full ``max_wait_ms`` until :data:`USELESS_WAITS` waits in a row saw no new request; then calls take only what
  is already queued, except every :data:`PROBE_EVERY`-th call, which waits as a probe. Each probe that sees nothing
  doubles the interval, up to :data:`MAX_PROBE_EVERY`, and a wait that sees a new request restores waiting. A
  lone client pays the wait on one call in 8, then 16, 32 and 64 (measured on an H200, SigLIP-so400m, one
  closed-loop client, before the device rule: 5.71 ms per request with a 2 ms wait on every call, 3.69 ms
  without waiting).
- **At most two calls on the device** (:data:`MAX_IN_FLIGHT`): one running and one queued behind it. A call that
  finds both still in flight could only queue behind them, so launching it sooner would not finish it sooner: it
  keeps gathering until the older of the two is done (at most :data:`HOLD_LIMIT_S` after its first request arrived,
  however long ``max_wait_ms``; ``stats["held_launches"]``). Without this rule a loaded server launched a small
  call every time its ``max_wait_ms`` ran out while the device was busy, and the device's queue, not the front's,
  held the waiting requests: on an H100 (SigLIP-so400m, 32 clients, host preprocessing) 2.2 requests a call and
  50.8 ms a request in the answer stage waiting for its call's copy
  (``benches/results/serving_nvidia-h100-80gb-hbm3_server_host_siglip_stream-handoff.md``), where a graph replay of
  2 images costs the device far more per image than one of 16.

``adaptive_wait=False`` waits up to ``max_wait_ms`` on every call. The policy is used from the front's worker
thread only.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["HOLD_LIMIT_S", "IDLE_POLL_S", "MAX_IN_FLIGHT", "MAX_PROBE_EVERY", "PROBE_EVERY", "USELESS_WAITS", "Wait",
           "WaitPolicy", "cuda_device"]

log = logging.getLogger("encgraph")

USELESS_WAITS = 3
"""Waits in a row that saw no new request before calls stop waiting (targets off CUDA)."""
PROBE_EVERY = 8
"""While calls do not wait, every this many-th call waits anyway, to see whether requests arrive again."""
MAX_PROBE_EVERY = 64
"""The longest probe interval: each probe that sees no new request doubles it, from :data:`PROBE_EVERY`."""
IDLE_POLL_S = 2.5e-4
"""While a call waits for more requests on a busy device, how often it looks whether the device went idle."""
MAX_IN_FLIGHT = 2
"""Calls a CUDA target's front keeps launched and unfinished on the device: the running one and one queued."""
HOLD_LIMIT_S = 1.0
"""The longest a call is held, after its first request arrived, while :data:`MAX_IN_FLIGHT` calls are in flight
(a guard: the device finishes the older call long before)."""


@attrs.frozen
class Wait:
    """One call's wait: gather until ``deadline`` (``time.monotonic()``), or until ``until()`` is true while the
    queue is empty (``None``: no such condition). ``skipped``: the call takes only what is already queued;
    ``idle``: because the device was idle; ``held``: the device has :data:`MAX_IN_FLIGHT` calls in flight, and the
    call gathers until the older is done."""

    deadline: float
    until: Callable[[], bool] | None = None
    skipped: bool = False
    idle: bool = False
    held: bool = False


class WaitPolicy:
    """The waits of one front's calls (see the module docs).

    Args:
        max_wait_s: the longest wait after a call's first request arrived.
        adaptive: wait less where the policy can tell that waiting gathers nothing.
        device: the CUDA device the target runs on (:func:`cuda_device`), or ``None``.
    """

    def __init__(self, max_wait_s: float, adaptive: bool, device: Any = None) -> None:
        self.max_wait_s, self.adaptive, self.device = max_wait_s, adaptive, device
        self._useless = 0  # waits in a row that saw no new request
        self._skipped = 0  # calls since the last wait
        self._probe_every = PROBE_EVERY  # doubles after each useless probe, up to MAX_PROBE_EVERY
        self._probe = False  # the current call is a probe
        # CUDA events recorded after the last calls (CUDA targets), oldest first.
        self._launched: collections.deque[Any] = collections.deque(maxlen=MAX_IN_FLIGHT)

    def wait(self, arrived: float) -> Wait:
        """The wait of a call whose first request arrived at ``arrived``."""
        deadline = arrived + self.max_wait_s
        if not self.adaptive or self.max_wait_s == 0:
            return Wait(deadline)
        if self.device is not None:
            launched = self._launched
            if not launched or launched[-1].query():  # the stream runs in order: the last done, all done
                return Wait(time.monotonic(), skipped=True, idle=True)
            older = launched[0]
            if len(launched) == MAX_IN_FLIGHT and not older.query():
                return Wait(arrived + max(self.max_wait_s, HOLD_LIMIT_S), until=older.query, held=True)
            return Wait(deadline, until=launched[-1].query)
        idle = self._useless >= USELESS_WAITS  # recent waits gathered nothing
        skip = idle and self._skipped < self._probe_every - 1
        self._probe = idle and not skip
        if skip:
            self._skipped += 1
            return Wait(time.monotonic(), skipped=True)
        self._skipped = 0
        return Wait(deadline)

    def waited(self, wait: Wait, timed_out: bool, arrived: bool) -> None:
        """What ``wait`` saw: it ended at its deadline (``timed_out``); a request ``arrived`` during it."""
        if wait.skipped or self.device is not None or not self.adaptive or self.max_wait_s == 0:
            return
        self._useless = self._useless + 1 if timed_out and not arrived else 0
        if not self._useless:
            self._probe_every = PROBE_EVERY
        elif self._probe:
            self._probe_every = min(2 * self._probe_every, MAX_PROBE_EVERY)

    def launched(self) -> None:
        """A call was just launched (on the worker thread): mark the device's stream after it. Where the marker
        cannot be recorded (a device in an error state: the call's own request has failed with it), the next
        call is treated as finding the device idle."""
        if self.device is None:
            return
        try:
            self._launched.append(launch_marker(self.device))
        except Exception as exc:  # never the front's worker's failure: it would fail every queued request
            log.warning("encgraph serving: could not mark the device's stream after a call (%s); the next call "
                        "does not wait", exc)
            self._launched.clear()


def cuda_device(target: Any) -> Any:
    """The CUDA device a target's runner runs on, or ``None`` (a CPU runner, a callable)."""
    device = getattr(getattr(target, "runner", None), "device", None)
    return device if getattr(device, "type", None) == "cuda" else None


def launch_marker(device: Any) -> Any:
    """A CUDA event recorded now on the calling thread's current stream of ``device``: ``query()`` is true once
    everything launched there so far (replays, the host copies a ``finish`` started) has run. Never syncs."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
