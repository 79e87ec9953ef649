"""FlashAttention-4 (the optional ``flash-attn-4`` wheel: CuTe DSL kernels for Hopper and Blackwell) as the packed
varlen kernel of a head geometry, where capture measured it faster than torch's own Flash Attention 2 build.

It is called directly (``flash_attn.cute.interface.flash_attn_varlen_func``), never through torch's hook
(``torch.nn.attention.activate_flash_attention_impl("FA4")``), which swaps the flash kernel of every module of the
process, the language model's included. Its kernels are compiled on the first call of each configuration (head
dim, dtype, and the host-side choices its ``max_seqlen`` enters): capture makes that call when it measures the
kernel (:func:`encgraph.models.kernel_choice.measure_crossover`), outside any graph. Like torch's, it takes the
lengths from the ``cu_seqlens`` tensor at run time and the longest from a host int, so one captured graph
serves every split of its rows.

Which geometries run it is the process's registry in :mod:`encgraph.models.varlen_kernel`, set at capture by
:mod:`encgraph.models.kernel_choice` from its measurement; it changes encgraph's own calls only. Importing this
module imports neither the wheel nor its compiler; :func:`available` does, once.
"""

from __future__ import annotations

import importlib.util
import logging
import time

import torch

__all__ = ["MAX_ROWS", "available", "bound", "varlen_attn", "warm"]

log = logging.getLogger("encgraph")

MAX_ROWS = 65536
"""The longest sequence :func:`warm` compiles for: Qwen's processors' largest image (16,384 tokens at merge 2)."""

_MODULE = "flash_attn.cute.interface"
_AVAILABLE: dict[int, bool] = {}  # per device index


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def bound(max_seqlen: int) -> int:
    """The ``max_seqlen`` FlashAttention-4 is called with: ``max_seqlen`` rounded up to a power of two, at least
    128. It enters the kernel's compiled configuration (tile and grid choices), and each new configuration
    compiles for seconds; an upper bound is as correct as the exact one, so a few bounds, all compiled at capture
    (:func:`warm`), serve every length.

    >>> [bound(n) for n in (1, 128, 129, 5120, 65536)]
    [128, 128, 256, 8192, 65536]
    """
    return max(128, 1 << (max(int(max_seqlen), 1) - 1).bit_length())


def _importable() -> bool:
    try:
        return importlib.util.find_spec(_MODULE) is not None
    except (ImportError, ValueError):  # a parent package that is not one (a stray ``flash_attn`` module)
        return False


def available(device: torch.device) -> bool:
    """Whether FlashAttention-4 can run on the CUDA ``device``: the wheel imports, and the device is a Hopper
    (compute capability 9.x) or a Blackwell (10.x) GPU. A failed import is logged once per device; such a GPU
    without the wheel logs, once per process, what it leaves and the install command (:data:`MISSING_HINT`)."""
    if device.type != "cuda":
        return False
    index = _index(device)
    if index not in _AVAILABLE:
        ok = False
        capable, importable = torch.cuda.get_device_capability(index)[0] in (9, 10), _importable()
        if capable and not importable:
            _hint_once(torch.cuda.get_device_name(index))
        if importable and capable:
            try:
                importlib.import_module(_MODULE)
                ok = True
            except Exception as exc:  # an installed but broken wheel leaves torch's kernel in place
                log.warning("encgraph: flash-attn-4 is installed but does not import (%s: %s); packed attention "
                            "keeps torch's Flash Attention kernel.", type(exc).__name__, exc)
        _AVAILABLE[index] = ok
    return _AVAILABLE[index]


MISSING_HINT = (
    "encgraph: FlashAttention-4 is not installed; on this {gpu} the packed attention runs torch's Flash Attention "
    "kernel instead. On an H200, FlashAttention-4 ran Qwen3-VL-8B's photo trace (every size new) at 2.3x Hugging "
    "Face's mean latency, against 1.7x without it (benches/results/traffic_nvidia-h200_photo-fa4.md). Install it "
    "with: pip install 'encgraph[fa4]' (for a CUDA 13 torch: 'encgraph[fa4-cu13]')."
)
"""What a capture on a Hopper or Blackwell GPU without the wheel logs, once per process."""
_HINTED: list[bool] = []


def _hint_once(gpu: str) -> None:
    if not _HINTED:
        _HINTED.append(True)
        log.warning(MISSING_HINT.format(gpu=gpu))


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None = None,
) -> torch.Tensor:
    """FlashAttention-4's non-causal varlen forward, in the signature of torch's ``varlen_attn``.

    Args:
        query, key, value: ``(tokens, heads, head_dim)`` fp16/bf16 on one CUDA device, head dim a multiple of 8
            (key/value may have fewer heads, a divisor of the query's).
        cu_seq_q, cu_seq_k: ``(slots,)`` int32, the bounds (read on the device).
        max_q, max_k: host ints at least the longest sequence of every call (and of every replay of a graph);
            rounded up by :func:`bound`.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``(tokens, heads, head_dim)`` in ``query``'s dtype, a fresh tensor; rows past ``cu_seq_q[-1]`` unwritten.
    """
    from flash_attn.cute.interface import flash_attn_varlen_func

    return flash_attn_varlen_func(query, key, value, cu_seqlens_q=cu_seq_q, cu_seqlens_k=cu_seq_k,
                                  max_seqlen_q=bound(max_q), max_seqlen_k=bound(max_k), softmax_scale=scale)[0]


def warm(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, max_rows: int = MAX_ROWS) -> float:
    """Compile, outside any graph, the kernels this geometry's calls can need: one call for each :func:`bound`
    from 128 to ``max_rows`` rows, on two short sequences (the bound is a hint; the work is tiny). Returns the
    seconds it took (compiles included; the wheel keeps them for the process). Syncs the host: capture time
    only."""
    start = time.perf_counter()
    with torch.inference_mode(), torch.cuda.device(device):
        q, k, v = (torch.randn(128, heads, head_dim, device=device, dtype=dtype) for _ in "qkv")
        cu = torch.tensor([0, 64, 128], device=device, dtype=torch.int32)
        rows = 128
        while rows <= bound(max_rows):
            varlen_attn(q, k, v, cu, cu, rows, rows)
            rows *= 2
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
