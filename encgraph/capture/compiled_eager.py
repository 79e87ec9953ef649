"""The compiled eager forward: the adapter's eager forward run through the blocks compiled for capture.

Why: items past the ladder's top (a photo at the processor's default size is up to 16,384 Qwen tokens, the
default ladder stops at 4,096) and batches the cost model sends eagerly run the adapter's eager forward, and
there the tower's element-wise work runs unfused: measured on an H200 for one 2688 px GLM-4.1V photo (36,864 patch
rows), 70 ms of element-wise kernels and 38 ms of copies and casts of a 509 ms forward, from the fp32 rotary
embedding and RMSNorm of Hugging Face's blocks (``benches/results/kernel_profile_nvidia-h200_glm-large.md``, in git at 8720e67). The
graphs already hold these blocks compiled (:mod:`encgraph.capture.compiling`: one compilation with a symbolic token
dimension); the same compiled callables serve an eager forward of any size without another trace, when the block's
inputs look as they did at capture.

Lifetime: :class:`CompiledEager` keeps the compiled callables of the capture's
:class:`~encgraph.capture.compiling.CompiledRegions` and sets them on the blocks only for the duration of one of
the runner's eager forwards (:meth:`CompiledEager.forward`), under the runner's lock; outside it the tower runs
exactly as before (its own forward, the adapter's plain eager forward, autograd); a call of the same tower from
another thread meanwhile runs the compiled blocks too (the same values within bf16 tolerance). The forward runs under
:func:`~encgraph.capture.grad.persistent`, as the capture did: grad mode and inference mode are part of what
Dynamo guards, and a call under ``torch.inference_mode()`` would otherwise trace the blocks again.

Correctness: the compiled eager forward engages only once it has been checked, at capture, against the plain
eager forward on the self-check's sample items (:meth:`CompiledEager.check`, the self-check's tolerance);
without a self-check it never engages. Attention inside a compiled block is one opaque op that finds the eager
forward's host bounds at run time (:func:`encgraph.models.attention._varlen_call`), so long sequences keep their
dense kernel. A failure of the compiled forward, or a check past tolerance, is logged once, the forward is run
plain, and compiled eager forwards stop (``stats["compiled_eager"]`` says why), under ``compile=True`` too: that
option makes the capture's compilation fail loudly; the eager forward has a correct plain twin to fall back to.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from encgraph.capture.compiling import CompiledRegions, frames_traced, no_duck_sizing, recompile_headroom
from encgraph.capture.grad import persistent
from encgraph.errors import EncgraphError

__all__ = ["EagerCompile", "CompiledEager"]

log = logging.getLogger("encgraph")


class EagerCompile(enum.Enum):
    """Whether the runner's eager forwards run through the compiled blocks."""

    OFF = "off"
    """Nothing compiled to reuse: compilation off or failed, or the adapter names no blocks."""
    PENDING = "pending"
    """Compiled blocks kept, not yet checked against the plain eager forward: eager forwards run plain."""
    ON = "on"
    """Checked at capture: eager forwards run through the compiled blocks."""
    FAILED = "failed"
    """Its check or a run failed (``reason``): eager forwards run plain from then on."""


class CompiledEager:
    """The compiled blocks of a capture, engaged around the runner's eager forwards.

    Args:
        regions: the capture's compiled regions, while still compiled (their ``_compiled_call_impl`` set);
            ``None`` or uncompiled regions give an :attr:`EagerCompile.OFF` holder.
    """

    def __init__(self, regions: CompiledRegions | None) -> None:
        active = regions is not None and regions.active and bool(regions.modules)
        self.modules: list[torch.nn.Module] = list(regions.modules) if active and regions is not None else []
        self.calls: list[Callable[..., Any]] = [m._compiled_call_impl for m in self.modules]
        self.status = EagerCompile.PENDING if self.modules and all(self.calls) else EagerCompile.OFF
        self.reason = "" if self.status is EagerCompile.PENDING else "no compiled blocks to reuse"
        self.runs = 0
        self.fallbacks = 0
        self.recompiles = 0
        self.worst_error: float | None = None

    @classmethod
    def off(cls, reason: str) -> CompiledEager:
        """A holder that never engages, with ``reason`` (e.g. the runner is not in GRAPH mode)."""
        holder = cls(None)
        holder.reason = reason
        return holder

    @property
    def engaged(self) -> bool:
        return self.status is EagerCompile.ON

    @contextlib.contextmanager
    def _blocks_compiled(self) -> Iterator[None]:
        for module, call in zip(self.modules, self.calls):
            module._compiled_call_impl = call
        try:
            with persistent(), no_duck_sizing(), recompile_headroom():
                yield
        finally:
            for module in self.modules:
                module._compiled_call_impl = None

    def _run(self, adapter: Any, path: str, inputs: Any) -> Mapping[str, torch.Tensor]:
        before = frames_traced()
        with self._blocks_compiled():
            out = adapter.forward_eager(path, inputs)
        traced = frames_traced() - before
        if traced and self.status is EagerCompile.ON:
            # Dynamo traced the blocks again while serving (a guard the capture's check did not meet): seconds
            # of one call, counted and logged rather than hidden.
            self.recompiles += traced
            log.info("encgraph: the compiled eager forward traced %d frame(s) again on path %r (%d so far).",
                     traced, path, self.recompiles)
        return out

    def forward(self, adapter: Any, path: str, inputs: Any) -> Mapping[str, torch.Tensor]:
        """``adapter.forward_eager(path, inputs)``, through the compiled blocks where :attr:`engaged`."""
        if not self.engaged:
            return adapter.forward_eager(path, inputs)
        try:
            out = self._run(adapter, path, inputs)
        except (EncgraphError, torch.OutOfMemoryError):
            raise  # the plain forward would raise it too (an input error, a too large batch)
        except Exception as exc:
            self.fail(f"a run on path {path!r} raised {type(exc).__name__}: {exc}")
            self.fallbacks += 1
            return adapter.forward_eager(path, inputs)
        self.runs += 1
        return out

    def check(self, adapter: Any, path: str, inputs: Any, reference: Mapping[str, torch.Tensor],
              error: Callable[[torch.Tensor, torch.Tensor], float], tolerance: float) -> None:
        """Run the compiled eager forward on ``inputs`` (Dynamo traces the blocks here, at capture, when their
        inputs differ from the static forward's) and compare each output with ``reference``, the plain eager
        forward's, by ``error``: past ``tolerance``, or a failure, ends compiled eager forwards. A pending holder
        that passes engages."""
        if self.status not in (EagerCompile.PENDING, EagerCompile.ON):
            return
        try:
            out = self._run(adapter, path, inputs)
        except EncgraphError:
            raise
        except Exception as exc:
            self.fail(f"its check on path {path!r} raised {type(exc).__name__}: {exc}")
            return
        worst = max((error(out[name], reference[name]), name) for name in reference)
        self.worst_error = worst[0] if self.worst_error is None else max(self.worst_error, worst[0])
        if not worst[0] <= tolerance:
            why = (f"output {worst[1]!r} on path {path!r} differs from the plain eager forward by {worst[0]:.3g} "
                   f"(norm-relative; tolerance {tolerance:g})")
            self.fail(why)
            return
        self.status = EagerCompile.ON

    def fail(self, reason: str) -> None:
        """Stop compiled eager forwards, logged once with ``reason``."""
        if self.status is not EagerCompile.FAILED:
            log.warning("encgraph: compiled eager forwards stop: %s; eager forwards run the plain blocks.", reason)
        self.status = EagerCompile.FAILED
        self.reason = reason[:300]

    def as_dict(self) -> dict[str, Any]:
        """``status``, ``reason``, ``runs`` (eager forwards run compiled), ``fallbacks`` (runs redone plain after
        a failure), ``recompiles`` (frames traced again once engaged: by a serving call, or by a later
        budget's check at capture), ``worst_error`` (the check's)."""
        return {"status": self.status.value, "reason": self.reason, "runs": self.runs, "fallbacks": self.fallbacks,
                "recompiles": self.recompiles, "worst_error": self.worst_error}

