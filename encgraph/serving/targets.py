"""What a :class:`~encgraph.serving.BatchingFront` runs: a runner, a graphed module, or any other callable.

A target turns one request (the arguments given to ``submit``) into a :class:`Parsed` request (validated inputs
and their item specs) and runs a group of parsed requests as one call, handing each request its own result.
Every method runs on the front's worker thread only, so adapters and runners are never used from two threads.

- :class:`RunnerTarget`: ``submit(inputs)`` with the adapter's inputs; a request's result is the runner's list
  of per-item results for its items, in order.
- :class:`GraphedTarget`: ``submit(*args, **kwargs)`` with the wrapped module's own forward arguments; a
  request's result is the module's own output type for its items (``adapter.output_for_call``).
- :class:`CallableTarget`: any other callable (an unwrapped tower, a function); requests run one at a time.

Coalescing needs the adapter's optional ``concat(parts)``; without it, a runner target runs requests one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from encgraph._validate import describe
from encgraph.errors import ConfigError, ConfigTypeError, InputError, InputTypeError
from encgraph.packing import ItemSpec

__all__ = ["Parsed", "RunnerTarget", "GraphedTarget", "CallableTarget", "Finishing", "make_target"]

log = logging.getLogger("encgraph")


@attrs.frozen(eq=False)
class Parsed:
    """One validated request.

    ``inputs``: the adapter's inputs (or ``(args, kwargs)`` for a request that runs alone); ``specs``: one
    :class:`~encgraph.packing.ItemSpec` per item; ``tokens``: per path, the budget units the request brings;
    ``alone``: the request is not coalesced (a callable target, or a call the graphs answer with the module's
    own forward).
    """

    inputs: Any
    specs: tuple[ItemSpec, ...] = ()
    tokens: Mapping[str, int] = attrs.field(factory=dict)
    alone: bool = False
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)


def _tokens(specs: Sequence[ItemSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for spec in specs:
        for path, n in spec.tokens.items():
            out[path] = out.get(path, 0) + n
    return out


class RunnerTarget:
    """Requests are adapter inputs, run by an :class:`~encgraph.EncoderGraphRunner`."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.coalesces = callable(getattr(self.adapter, "concat", None))
        if not self.coalesces:
            log.info("encgraph serving: %s has no concat(parts); requests run one by one", type(self.adapter).__name__)

    def capture(self) -> None:
        self.runner.capture()

    def caps(self) -> dict[str, int]:
        """Per path, the largest budget of its ladder: the default most units one coalesced call holds."""
        return {path: max(ladder) for path, ladder in self.runner.ladders.items()}

    def parse(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Parsed:
        if len(args) != 1 or kwargs:
            raise InputTypeError(
                f"submit: a runner takes one argument (the adapter's inputs), got {len(args)} positional and "
                f"keywords {sorted(kwargs)}."
            )
        return self._parsed(args[0])

    def _parsed(self, inputs: Any) -> Parsed:
        specs = tuple(self.adapter.item_specs(inputs))
        if not specs:
            raise InputError("inputs: expected at least one item, got an empty batch.")
        return Parsed(inputs, specs, _tokens(specs))

    def run(self, group: Sequence[Parsed]) -> list[Any]:
        """One result per request of ``group``: one runner call over all their items, split back per request."""
        if len(group) == 1:
            return [self.finish(group[0], self.runner(group[0].inputs))]
        results = self.runner(self.adapter.concat([p.inputs for p in group]))
        out, start = [], 0
        for parsed in group:
            n = len(parsed.specs)
            out.append(self.finish(parsed, results[start : start + n]))
            start += n
        return out

    def finish(self, parsed: Parsed, results: list[Any]) -> Any:
        return list(results)


class GraphedTarget:
    """Requests are the forward arguments of a graphed module (:func:`encgraph.graphed`); each request's result is
    the module's own output for its items.

    A module with a model adapter: requests are parsed by the adapter and coalesced through its ``concat`` into one
    runner call (the adapter's ``output_for_call`` gives each request its part). Any other module: requests of one
    call shape (:mod:`encgraph.models.call_spec`) are concatenated in dim 0 and coalesced into one call of the
    module (whose hook replays that shape's graphs), and each request gets its rows of every output tensor. A request
    the graphs cannot answer (a call the module's own forward answers) runs alone, through the module.
    """

    def __init__(self, module: Any) -> None:
        from encgraph.models.graphed import graphs

        self.module = module
        self.hook = graphs(module)
        self.family = self.hook.family
        self.coalesces = not self.family or callable(getattr(self.hook.adapter, "concat", None))

    @property
    def runner(self) -> Any:
        """What the front reads ``stats`` and ``device`` from: the hook (its stats cover every call shape)."""
        return self.hook

    def capture(self) -> None:
        if self.family:
            self.hook.capture()

    def caps(self) -> dict[str, int]:
        if self.family:
            return {path: max(ladder) for path, ladder in self.hook.runner.ladders.items()}
        return {"default": self.hook.max_batch}

    def parse(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Parsed:
        from encgraph.capture.protocol import StockCall
        from encgraph.models.call_spec import split_call

        if self.family:
            inputs = self.hook.adapter.inputs_from_call(*args, **dict(kwargs))
            if isinstance(inputs, StockCall):  # the module's own forward answers it (counted there): alone
                return Parsed(None, alone=True, args=args, kwargs=kwargs)
            specs = tuple(self.hook.adapter.item_specs(inputs))
            return Parsed(inputs, specs, _tokens(specs), args=args, kwargs=kwargs)
        split = split_call(args, dict(kwargs))
        if isinstance(split, str) or split.batch == 0 or not self.hook.holds(split):
            # A shape the module answers itself (one not seen yet, or not split per item): alone.
            return Parsed(None, alone=True, args=args, kwargs=kwargs)
        specs = (ItemSpec(1),) * split.batch
        return Parsed(split, specs, {"default": split.batch}, args=args, kwargs=kwargs)

    def run(self, group: Sequence[Parsed]) -> list[Any]:
        if len(group) == 1:
            return [self.module(*group[0].args, **group[0].kwargs)]
        if self.family:
            return self._run_family(group)
        return self._run_shapes(group)

    def _run_family(self, group: Sequence[Parsed]) -> list[Any]:
        self.hook.check()
        adapter, runner = self.hook.adapter, self.hook.runner
        results = runner(adapter.concat([p.inputs for p in group]))
        out, start = [], 0
        for parsed in group:
            n = len(parsed.specs)
            out.append(adapter.output_for_call(list(results[start : start + n]), parsed.inputs))
            start += n
        return out

    def _run_shapes(self, group: Sequence[Parsed]) -> list[Any]:
        import torch
        import torch.utils._pytree as pytree

        from encgraph.models.call_spec import rebuild

        out: list[Any] = [None] * len(group)
        by_shape: dict[Any, list[int]] = {}
        for i, parsed in enumerate(group):
            by_shape.setdefault(parsed.inputs.key, []).append(i)
        for key, members in by_shape.items():
            if len(members) == 1:
                out[members[0]] = self.module(*group[members[0]].args, **group[members[0]].kwargs)
                continue
            columns = zip(*(group[i].inputs.tensors for i in members))
            args, kwargs = rebuild(key, [torch.cat(column) for column in columns])
            leaves, spec = pytree.tree_flatten(self.module(*args, **kwargs))
            start = 0
            for i in members:
                n = group[i].inputs.batch
                part = [t[start : start + n] if isinstance(t, torch.Tensor) else t for t in leaves]
                out[i] = pytree.tree_unflatten(part, spec)
                start += n
        return out


class CallableTarget:
    """Any other callable: each request is ``fn(*args, **kwargs)``, one at a time, nothing coalesced."""

    coalesces = False
    runner = None

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def capture(self) -> None:
        return None

    def caps(self) -> dict[str, int]:
        return {}

    def parse(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Parsed:
        return Parsed(None, alone=True, args=args, kwargs=kwargs)

    def run(self, group: Sequence[Parsed]) -> list[Any]:
        return [self.fn(*p.args, **p.kwargs) for p in group]


def make_target(target: Any) -> RunnerTarget | CallableTarget:
    """The target kind of ``target``: a runner, a graphed module, or a callable."""
    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.models.own_forward import HOOK_MARK

    if isinstance(target, (RunnerTarget, GraphedTarget, CallableTarget)):
        return target
    if isinstance(target, EncoderGraphRunner):
        return RunnerTarget(target)
    if getattr(getattr(target, "__dict__", {}).get("forward"), HOOK_MARK, False):
        return GraphedTarget(target)
    if callable(target):
        return CallableTarget(target)
    raise ConfigTypeError(
        f"target: expected an EncoderGraphRunner, a graphed module (encgraph.graphed) or a callable, got "
        f"{describe(target)}."
    )


@attrs.frozen
class Finishing:
    """What a front does with a call's results before each request gets its own (``BatchingFront``'s ``finish``
    and ``finish_call``; on the worker, right after the call, for work that must follow the call on its stream).

    ``each(result)``: per request; one that raises fails its request alone. ``call(results)``: once per call, the
    requests' results in order in, one value per request out in the same order (one device-to-host copy for the
    whole call: :meth:`encgraph.serving.transfer.PinnedBuffers.copy`); one that raises, or returns another number
    of values, fails every request of the call, each with an error of its own that names the call and the
    cause. Neither: each request gets its result."""

    each: Callable[[Any], Any] | None = None
    call: Callable[[list[Any]], Any] | None = None

    @classmethod
    def of(cls, finish: Any, finish_call: Any) -> Finishing:
        """The checked ``finish`` and ``finish_call`` arguments of a front (at most one of them)."""
        for key, fn in (("finish", finish), ("finish_call", finish_call)):
            if fn is not None and not callable(fn):
                raise ConfigTypeError(f"{key}: expected a callable or None, got {describe(fn)}.")
        if finish is not None and finish_call is not None:
            raise ConfigError("finish, finish_call: expected at most one of them, got both.")
        return cls(finish, finish_call)

    def __call__(self, results: list[Any]) -> list[tuple[Any, BaseException | None]]:
        """Per request, in order: ``(value, None)``, or ``(None, error)`` where it failed."""
        if self.call is None:
            return [self._one(r) for r in results]
        try:
            finished = list(self.call(results))
            if len(finished) != len(results):
                raise RuntimeError(f"finish_call returned {len(finished)} values for {len(results)} requests")
        except Exception as exc:
            why = f"finishing this request's call of {len(results)} requests failed ({type(exc).__name__}: {exc})."
            return [(None, _caused(RuntimeError(why), exc)) for _ in results]
        return [(value, None) for value in finished]

    def _one(self, result: Any) -> tuple[Any, BaseException | None]:
        if self.each is None:
            return result, None
        try:
            return self.each(result), None
        except Exception as exc:  # this request's finishing failed: it alone fails
            return None, exc


def _caused(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc
