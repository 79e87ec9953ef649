"""Compiling the static forward: once per path for every budget, with torch's persistent caches.

Why one compilation: compiling each budget's static forward separately (``dynamic=False``) cost 20-24 s per
budget on an H200 for the Qwen2.5-VL-7B tower, 139-178 s per ladder, and torch's FX-graph and AOTAutograd caches
only remove the inductor part of it in a second process (44.6 s warm: about 6 s of Dynamo tracing per budget
remain; see DESIGN.md). So compilation uses a symbolic token dimension (``dynamic=True``): every budget's graph
is captured from the same compiled code, the per-layer ``max_seqlen`` being a symbolic size derived from the
buffers' shapes (adapters pass it as such, never ``int()`` it), so no budget adds a guard or a recompile. Duck
sizing is off while it traces, so that two buffers whose sizes happen to be equal at the first budget are not
assumed equal at every budget.

What is compiled: where the adapter names the tower's repeated blocks (``compile_regions()``, e.g. the 32
vision blocks of Qwen2.5-VL), each block is compiled with ``nn.Module.compile`` - one trace and one inductor
compilation serve every block and every budget, since the blocks share their code - and the rest of the
static forward (patch embedding, rotary tables, merger: a few kernels) is captured as it is. Measured on an
H200 (torch 2.11, Qwen2.5-VL-7B tower, depth 32, the dense 20-budget ladder): compiling the whole static forward
once with dynamic shapes took 97 s cold and 68 s in a second process (9 graph breaks, 16 graphs); regional, once
a graph break at the varlen call was removed (a ``math.isclose`` of a symbolic scale), the whole ``capture()``,
compile, 20 graphs, self-check and cost model included, took 16.1 s cold and 14.7 s in a second process
(``benches/results/traffic_nvidia-h200.json``; 14.7 s and 16.2 s for Qwen3-VL-8B), with one graph per kind of
block and no break. The blocks are compiled only while the runner
captures: afterwards their ``_compiled_call_impl`` is cleared, so the tower's own forward, the adapter's eager
forward and calls answered by the stock tower run uncompiled (the graphs hold the compiled kernels).

Caches: inductor's FX-graph and AOTAutograd caches live in ``TORCHINDUCTOR_CACHE_DIR``; unless the user set that
variable, the runner points it, for the duration of its compile and capture only, at :func:`default_cache_dir`
(``$ENCGRAPH_CACHE_DIR``, else ``$XDG_CACHE_HOME/encgraph/torch``, else ``~/.cache/encgraph/torch``) or the
runner's ``cache_dir``, with torch's own ``temporary_cache_dir``. A second process on the same machine then
skips inductor and AOTAutograd and pays Dynamo's tracing once per path.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from encgraph._validate import describe
from encgraph.errors import ConfigError, ConfigTypeError

__all__ = [
    "CompileMode", "CompiledRegions", "Sizes", "resolve_compile", "default_cache_dir", "compile_cache", "compile_dynamic",
    "dynamic_sizes",
    "compile_stats", "frames_traced", "no_duck_sizing", "recompile_headroom", "RECOMPILE_HEADROOM",
]


class CompileMode(enum.Enum):
    """Whether the runner compiles its static forwards before capturing them."""

    OFF = "off"
    """Capture the static forward as it is (eager kernels)."""
    ON = "on"
    """Compile (one compilation per path for every budget); a failure is raised."""
    AUTO = "auto"
    """Compile where it works: on a failure, log it once, capture the plain forward, and record the reason in
    ``capture_info["compile"]`` (the default on CUDA)."""


class Sizes(enum.Enum):
    """An adapter's ``compile_dynamic`` beyond torch's own ``dynamic=`` values (:func:`dynamic_sizes`)."""

    BATCH = "batch"
    """Each compiled region's batch symbolic from its first trace, every other size static: dim 0 of the region's
    first tensor argument marked dynamic before each call (``torch._dynamo.maybe_mark_dynamic``), traced with
    ``backed_size_oblivious`` so that a batch of 1 is not specialised. One frame serves every budget of a batch
    ladder, 1 included: torch's automatic dynamic compiles the first budget static, then the batch symbolic, then
    a batch of 1 again (three frames), which a region holding the whole stack of blocks pays at about 20 s each
    (SigLIP-so400m on an H100, ``benches/results/generic_compile_nvidia-h100-80gb-hbm3_stack-region.md``). Where
    there are no regions, the whole static forward is compiled with torch's automatic dynamic."""
    TOP_STATIC = "top-static"
    """The largest budget with every size static, in a frame of its own, and every smaller budget through
    :attr:`BATCH`'s one batch-symbolic frame: two frames for a ladder, one for a ladder of one budget. The first
    batch a compiled region (or the whole forward) is called with goes to the static frame, every other batch to
    the symbolic one; the capture warms up largest first (design rule 10), so that first batch is the top budget's,
    whose kernels are then compiled for its own size, as ``torch.compile(mode="reduce-overhead")`` compiles them.

    Why a frame of its own: Dynamo looks a code object's cache entries up most recently used first and runs the
    first whose guards pass (``lookup`` and ``move_to_front`` in torch's ``torch/csrc/dynamo/extra_state.cpp``). So
    under torch's automatic dynamic, the batch-symbolic entry traced after the top budget's static one also serves
    the top budget from then on: on the CPU (torch 2.13) a call at the top budget after the smaller budgets ran the
    symbolic entry. Here the top budget is compiled by a ``torch.compile(dynamic=False)`` of a function of its own
    (``_static_region``, or ``_static_whole`` for a whole forward), so its entries are static and apart twice over:
    on their own code object, and under a backend that the symbolic frame's does not match (Dynamo runs only
    entries whose backend equals the caller's, and torch's backend wrappers compare their ``dynamic``).

    Measured on the CPU only (``tests/unit/test_compiling_top_static.py``): two frames for a ladder of 1, 2, 4, 8,
    the top budget's calls run the static entry before and after the smaller budgets, outputs equal the uncompiled
    forward. Not measured on a GPU: whether its top-budget kernels beat :attr:`BATCH`'s (SigLIP-so400m at 32
    images on an H100: 54.19 ms under BATCH against 50.88 under reduce-overhead) and what the second frame costs in
    warm-up (``benches/generic_compile.py``'s ``blocks/top-static`` and ``stack/top-static``). Not a default."""


def resolve_compile(value: Any, *, graph_mode: bool) -> CompileMode:
    """``compile=`` as a :class:`CompileMode`: ``True``/``False``/``"auto"`` (or a mode); ``"auto"`` is OFF
    outside the GRAPH mode (nothing is captured there)."""
    if isinstance(value, CompileMode):
        mode = value
    elif value is True:
        mode = CompileMode.ON
    elif value is False or value is None:
        mode = CompileMode.OFF
    elif isinstance(value, str) and value in ("auto", "on", "off"):
        mode = CompileMode(value)
    else:
        raise ConfigTypeError(f"compile: expected True, False or 'auto', got {describe(value)}.")
    if mode is CompileMode.ON and not graph_mode:
        raise ConfigError("compile: only the GRAPH mode compiles its static forwards (CUDA); leave compile unset.")
    if mode is CompileMode.AUTO and not graph_mode:
        return CompileMode.OFF
    return mode


def default_cache_dir() -> Path:
    """Where compiled artifacts persist across processes: ``$ENCGRAPH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/encgraph/torch``, else ``~/.cache/encgraph/torch``."""
    env = os.environ.get("ENCGRAPH_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "encgraph" / "torch"


@contextlib.contextmanager
def compile_cache(cache_dir: str | os.PathLike[str] | None) -> Iterator[str]:
    """Inductor's cache directory for the block: the user's ``TORCHINDUCTOR_CACHE_DIR`` when set (and no
    ``cache_dir`` is given), else ``cache_dir`` or :func:`default_cache_dir`, through torch's own
    ``temporary_cache_dir`` (the environment is restored after). Yields the directory used."""
    user = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir is None and user and not _torch_default(user):
        yield user
        return
    directory = str(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    os.makedirs(directory, exist_ok=True)
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:  # older layouts: set the variable by hand
        temporary_cache_dir = _env_cache_dir
    with temporary_cache_dir(directory):
        yield directory


def _torch_default(directory: str) -> bool:
    # torch writes its default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR the first time it
    # resolves the directory: that value is torch's, not a choice of the user's.
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
    except ImportError:
        return False
    return os.path.abspath(directory) == os.path.abspath(torch_default())


@contextlib.contextmanager
def _env_cache_dir(directory: str) -> Iterator[None]:
    original = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if original is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = original


def compile_dynamic(fn: Callable[..., Any], dynamic: bool | Sizes | None = True, *,
                    backend: str | Callable[..., Any] = "inductor") -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=dynamic)`` (inductor, no cudagraphs of its own); trace it inside
    :func:`no_duck_sizing`. ``dynamic``: an adapter's :func:`dynamic_sizes` (:attr:`Sizes.BATCH`: torch's
    automatic dynamic, the whole forward's arguments being the runner's, not a region's; :attr:`Sizes.TOP_STATIC`:
    the first budget static in a frame of its own, the others through torch's automatic dynamic)."""
    import torch

    compiled = torch.compile(fn, dynamic=None if isinstance(dynamic, Sizes) else dynamic, backend=backend)
    if dynamic is Sizes.TOP_STATIC:
        return _TopStatic(_static_whole, backend).route(fn, compiled)
    return compiled


def dynamic_sizes(adapter: Any) -> bool | Sizes | None:
    """How an adapter's static forward is compiled: ``True`` (the default: every size symbolic, for adapters whose
    budgets change several sizes, token rows and metadata alike) or ``None`` (torch's automatic dynamic: sizes are
    static until a budget changes them, so a batch ladder compiles its largest budget with static sizes, then the
    batch dimension alone symbolic; the adapter's ``compile_dynamic`` attribute), or ``False`` (every budget
    compiled with its own static sizes: one frame per budget, up to torch's recompile limit; what
    ``benches/generic_compile.py``'s ``blocks/static`` measures against the automatic default), or
    :attr:`Sizes.BATCH` (the batch alone symbolic from the first trace, one frame for every budget: the batch
    ladders' default), or :attr:`Sizes.TOP_STATIC` (the top budget static in a frame of its own, the others as
    under BATCH: two frames)."""
    value = getattr(adapter, "compile_dynamic", True)
    if not any(value is allowed for allowed in (True, None, False, *Sizes)):  # not 0 or 1
        raise ConfigError(f"{type(adapter).__name__}.compile_dynamic: expected True, None, False, Sizes.BATCH or "
                          f"Sizes.TOP_STATIC, got {describe(value)}.")
    return value


def _batch_symbolic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a region's compiled call) with :attr:`Sizes.BATCH`'s marking and tracing option around it."""
    import torch
    from torch.fx.experimental import _config as fx_config

    def call(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim()), None)
        if first is not None:
            torch._dynamo.maybe_mark_dynamic(first, 0)
        with fx_config.patch(backed_size_oblivious=True):
            return compiled(*args, **kwargs)

    return call


def _static_region(module: Any, *args: Any, **kwargs: Any) -> Any:
    """A region's call, for :attr:`Sizes.TOP_STATIC`'s static frame: Dynamo keeps its cache entries on this
    function's code object, apart from the symbolic frame's (``nn.Module._call_impl``'s)."""
    return module._call_impl(*args, **kwargs)


def _static_whole(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A whole static forward's call, for :attr:`Sizes.TOP_STATIC`'s static frame (its own code object, as
    :func:`_static_region`)."""
    return forward(*args, **kwargs)


class _TopStatic:
    """:attr:`Sizes.TOP_STATIC`'s routing for one capture: the first batch seen (dim 0 of the first tensor among the
    arguments, nested ones included), ``top``, runs ``frame`` compiled with every size static (``dynamic=False``);
    every other batch runs the call it is given (the batch-symbolic one). One instance serves every region of a
    capture, so that all of them agree on ``top`` and share the static frame."""

    def __init__(self, frame: Callable[..., Any], backend: Any) -> None:
        import torch

        self.top: int | None = None
        self.static = torch.compile(frame, dynamic=False, backend=backend)

    def route(self, target: Any, symbolic: Callable[..., Any]) -> Callable[..., Any]:
        """The call for ``target`` (a region's module, or a whole forward): ``frame(target, ...)`` static at the
        top batch, ``symbolic(...)`` at any other."""
        import torch
        from torch.utils._pytree import tree_leaves

        def call(*args: Any, **kwargs: Any) -> Any:
            size = next((int(a.shape[0]) for a in tree_leaves((args, kwargs))
                         if isinstance(a, torch.Tensor) and a.dim()), None)
            if self.top is None:
                self.top = size
            if size == self.top:
                return self.static(target, *args, **kwargs)
            return symbolic(*args, **kwargs)

        return call


@contextlib.contextmanager
def no_duck_sizing() -> Iterator[None]:
    """Trace without assuming that equal sizes are the same symbol (they are not, at another budget)."""
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(use_duck_shape=False):
        yield


RECOMPILE_HEADROOM = 64
"""The least ``torch._dynamo.config.recompile_limit`` while a capture compiles. Compiled regions are often one
shared code object (transformers' ``GradientCheckpointingLayer.__call__`` wraps every layer class), so each tower
captured in a process adds a compilation of it; past torch's default of 8 (hit in one process running the GPU
tests) dynamo would run the rest uncompiled, with only a warning. Replays never enter dynamo, so the limit is
raised for the capture only."""


@contextlib.contextmanager
def recompile_headroom() -> Iterator[None]:
    """``torch._dynamo.config.recompile_limit`` at least :data:`RECOMPILE_HEADROOM` inside the block (and the
    accumulated limit at least as high), as it was after."""
    from torch._dynamo import config as dynamo_config

    limits = {name: max(getattr(dynamo_config, name), RECOMPILE_HEADROOM)
              for name in ("recompile_limit", "accumulated_recompile_limit") if hasattr(dynamo_config, name)}
    with dynamo_config.patch(**limits):
        yield


class CompiledRegions:
    """The repeated blocks an adapter names (``compile_regions()``), compiled for the duration of a capture.

    ``compile()`` calls ``nn.Module.compile(dynamic=...)`` on each (:func:`dynamic_sizes`); ``restore()``
    (idempotent) clears their compiled call again, so outside the capture the tower runs exactly as before.
    """

    def __init__(self, adapter: Any, *, backend: str | Callable[..., Any] = "inductor") -> None:
        hook = getattr(adapter, "compile_regions", None)
        self.modules = list(hook()) if hook is not None else []
        self.dynamic = dynamic_sizes(adapter)
        self.backend = backend
        self.active = False
        self.top_static: _TopStatic | None = None  # Sizes.TOP_STATIC's routing from compile() (.top: static)

    def compile(self) -> None:
        batch = isinstance(self.dynamic, Sizes)
        self.top_static = _TopStatic(_static_region, self.backend) if self.dynamic is Sizes.TOP_STATIC else None
        for module in self.modules:
            module.compile(dynamic=None if batch else self.dynamic, backend=self.backend)
            if batch:
                module._compiled_call_impl = _batch_symbolic(module._compiled_call_impl)
            if self.top_static is not None:
                module._compiled_call_impl = self.top_static.route(module, module._compiled_call_impl)
        self.active = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The blocks run uncompiled inside the block, compiled again after it with the same compiled callables
        (Dynamo's caches kept): the capture's eager phase runs the plain eager forward between the warm-ups and
        the first graph (:func:`encgraph.capture.capture.capture_graphs`), and the compiled eager forward, which
        sets and clears the same attribute per run (:mod:`encgraph.capture.compiled_eager`)."""
        calls = [m._compiled_call_impl for m in self.modules] if self.active else []
        for module in self.modules if self.active else ():
            module._compiled_call_impl = None
        try:
            yield
        finally:
            for module, call in zip(self.modules, calls):
                module._compiled_call_impl = call

    def restore(self) -> None:
        if not self.active:
            return
        for module in self.modules:
            # nn.Module.compile keeps its compiled callable here (torch >= 2.2); None is its "not compiled".
            module._compiled_call_impl = None
        self.active = False

    def describe(self) -> dict[str, Any]:
        names = sorted({type(m).__name__ for m in self.modules})
        return {"count": len(self.modules), "classes": names}


_LIMIT_PHRASES = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")


def frames_traced() -> int:
    """Frames Dynamo has compiled in this process so far (``compile_stats()["frames_ok"]``), read alone: what a
    caller on a serving path compares before and after one call."""
    from torch._dynamo.utils import counters

    return int(counters["frames"].get("ok", 0))


def compile_stats() -> dict[str, int]:
    """Dynamo's running counters for deltas: frames it compiled (``frames_ok``) and tried (``frames_total``),
    unique graphs, graph breaks, recompiles, and ``recompile_limit``: frames it gave up on at its recompile limit
    (they then run uncompiled)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    limit = sum(n for reason, n in counters["unimplemented"].items()
                if any(p in reason.lower() for p in _LIMIT_PHRASES))
    return {
        "frames_ok": int(frames.get("ok", 0)),
        "frames_total": int(frames.get("total", 0)),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
        "recompile_limit": int(limit),
    }
