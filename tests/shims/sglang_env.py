"""What SGLang 0.5.23 needs to import and build its Qwen-VL vision towers on this CPU machine, for the tests.

- ``torchvision``: the PyPI wheels are CUDA builds (their ``_C.so`` needs ``libtorch_cuda.so``), and this machine
  has torch's CPU build, so ``import torchvision`` fails. SGLang imports it at module level in
  ``sglang.srt.multimodal.internvl_utils`` (reached from ``sglang.srt.configs``) and its processors; nothing on
  the vision-tower path calls it. Where it cannot be imported, a meta-path finder answers ``torchvision.*``
  imports with ``MagicMock`` modules, after transformers has cached "torchvision not available" (so that
  transformers does not take the stand-in for the real package).
- The rotary layer's module flag ``_is_cpu`` set: it is SGLang's ``is_cpu()``, true only with
  ``SGLANG_USE_CPU_ENGINE=1``, which also needs the CPU build of ``sgl_kernel`` (not on PyPI); without it the
  layer asks for vLLM's compiled rotary kernel. With the flag it uses its own torch code.
- A published server config with ``mm_attention_backend="sdpa"`` (SGLang's own test hook
  ``override_server_args``) and a one-process gloo group for its tensor-parallel layers.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import socket
import sys
from unittest import mock


class _StandIn:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


_READY = False


def prepare() -> None:
    """Make ``import sglang.srt.models.qwen2_5_vl`` work and its vision towers constructible (idempotent)."""
    global _READY
    if _READY:
        return
    try:
        import torchvision  # noqa: F401
    except Exception:
        import transformers.utils.import_utils as iu

        assert not iu.is_torchvision_available() or "torchvision" in sys.modules
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _StandIn())
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(mm_attention_backend="sdpa").install()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel()
    import sglang.srt.layers.rotary_embedding.base as rotary

    rotary._is_cpu = True
    _READY = True


def available() -> bool:
    return importlib.util.find_spec("sglang") is not None
