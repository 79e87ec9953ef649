"""Thin shims that put encgraph's runner behind a serving engine's own interface.

One module per engine, each importing its engine only inside functions (``import encgraph.shims.vllm`` works
without vLLM installed, and ``import encgraph`` never imports either engine):

- :mod:`encgraph.shims.vllm`: :class:`~encgraph.shims.vllm.VllmProtocolAdapter` (any model implementing vLLM's
  ``SupportsEncoderCudaGraph`` protocol as an encgraph adapter) and
  :class:`~encgraph.shims.vllm.ProtocolGraphManager` (vLLM's manager interface over the runner), both without
  vLLM; ``EncoderCudaGraphManager``, a subclass of vLLM's own manager built on first use; and the
  ``vllm.general_plugins`` entry point that installs it when ``ENCGRAPH_VLLM=1``.
- :mod:`encgraph.shims.sglang`: a drop-in for SGLang's ``ViTCudaGraphRunner`` (the object SGLang's Qwen2.5-VL and
  Qwen3-VL vision towers call), backed by the runner.
"""
