"""FlashInfer's ragged prefill as one more packed-attention kernel of ``benches/attention_kernels.py``.

``flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper`` (the ``flashinfer-python`` wheel; its CUDA kernels are
compiled by ``nvcc`` on the machine, at the first call of each head geometry, and cached under
``FLASHINFER_WORKSPACE_BASE``) splits its work on the host: ``plan()`` reads the sequence lengths there and
writes the split into the wrapper's device buffers, ``run()`` launches the kernel and reads only those buffers.
So, unlike torch's ``varlen_attn``, it cannot read new lengths from a captured ``cu_seqlens`` buffer: a graph of
it replays for other lengths only after ``plan()`` ran again on the host (:meth:`FlashInferRagged.replan`),
which is what encgraph's runner could do, since its host plan knows every length before each replay.

The wrapper is built with ``use_cuda_graph=True`` (fixed index buffers, as a captured graph needs) and
``backend="auto"`` (FlashInfer picks FA3 on sm90 where the head dim has an FA3 instantiation, FA2 otherwise);
the backend it used is reported per row (:meth:`FlashInferRagged.describe`). Eager calls plan once per new
split, as a forward would once per batch for all its layers; the plan's host time is not in the kernel's time.
"""

from __future__ import annotations

from typing import Any

WORKSPACE_BYTES = 256 << 20
"""FlashInfer's float workspace (split-KV partial outputs); its examples use 128 MiB, doubled for 27,000 rows."""

MERGE_HEAD_DIMS = (64, 128, 256)
"""Head dims FlashInfer's split-KV merge (``VariableLengthMergeStates``, ``cascade.cuh``) is built for: at any
other (72, 80) a split plan fails at run time ("Unsupported head_dim: 72", flashinfer 0.7.4 on the H200), so those
are planned with ``disable_split_kv``."""


class FlashInferRagged:
    """A kernel of the bench's signature ``(q, k, v, cu, max_len, lengths) -> out``: ``q, k, v`` are
    ``(tokens, heads, head_dim)`` bf16 on CUDA, ``cu`` the ``(sequences + 1,)`` int32 offsets (``lengths`` the
    same on the host), ``out`` is ``(tokens, heads, head_dim)``. One wrapper per geometry and sequence count,
    its workspace held for the process's life."""

    def __init__(self) -> None:
        self._wrappers: dict[tuple[Any, ...], Any] = {}
        self._planned: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._backend = "not built"

    def _key(self, q: Any, k: Any, cu: Any) -> tuple[Any, ...]:
        # The rows too: a wrapper in CUDA-graph mode keeps the row count of its first plan as its maximum.
        return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], cu.numel(), q.dtype, str(q.device))

    def _wrapper(self, q: Any, k: Any, cu: Any) -> Any:
        import torch
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

        key = self._key(q, k, cu)
        if key not in self._wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._wrappers[key] = BatchPrefillWithRaggedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.empty_like(cu),
                kv_indptr_buf=torch.empty_like(cu), backend="auto")
        return self._wrappers[key]

    def replan(self, q: Any, k: Any, cu: Any, lengths: list[int]) -> None:
        """Plan ``lengths`` (host ints) for the wrapper of ``q``'s geometry: host work and copies into the
        wrapper's buffers, never inside a capture."""
        import itertools

        import torch

        key = self._key(q, k, cu)
        offsets = (0, *itertools.accumulate(lengths))
        if self._planned.get(key) == offsets:
            return
        host = torch.tensor(offsets, dtype=torch.int32)
        wrapper = self._wrapper(q, k, cu)
        wrapper.plan(host, host, q.shape[1], k.shape[1], q.shape[2], causal=False, q_data_type=q.dtype,
                     kv_data_type=k.dtype, disable_split_kv=q.shape[2] not in MERGE_HEAD_DIMS)
        self._planned[key] = offsets
        self._backend = str(getattr(wrapper, "_backend", "unknown"))

    def __call__(self, q: Any, k: Any, v: Any, cu: Any, max_len: int, lengths: list[int]) -> Any:
        import torch

        if not torch.cuda.is_current_stream_capturing():
            self.replan(q, k, cu, lengths)
        return self._wrapper(q, k, cu).run(q, k, v)

    def describe(self) -> dict[str, Any]:
        """What a row reports beside its times: the FlashInfer version and the backend ``auto`` chose."""
        import flashinfer

        return {"flashinfer": getattr(flashinfer, "__version__", "unknown"), "backend": self._backend}
