"""Nothing else in the process changes (issue 32 point 5): wrapping a tower with ``encgraph.graphed``, capturing it
and calling it leaves the process-wide settings as it found them: torch's SDPA backend flags, cuDNN and matmul
precision settings, the default dtype, thread counts, grad modes, dynamo and inductor configs, and the
transformers attention registry entries other models use (encgraph adds its own name and changes no other).
Each tiny tower of tests/models, in a state made unusual first (so that a "reset to the default" is caught too)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.config

import encgraph
from encgraph.models.attention import ATTENTION_NAME
from tests.models import fixtures_fixed
from tests.models.fixtures_multipath import gemma4_tower
from tests.models.test_attention import _eager_towers
from tests.models.versions import skip_below


def _towers() -> dict[str, Callable[[], torch.nn.Module]]:
    towers = dict(_eager_towers())
    towers.update(siglip=fixtures_fixed.tiny_siglip, clip=fixtures_fixed.tiny_clip,
                  internvl=fixtures_fixed.tiny_internvl, gemma4=gemma4_tower)
    return towers


def snapshot() -> dict[str, Any]:
    """Every process-wide setting a wrapper could plausibly touch."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from transformers import AttentionInterface

    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    state: dict[str, Any] = {
        "sdp": (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                cuda.cudnn_sdp_enabled()),
        "matmul": (cuda.matmul.allow_tf32, cuda.matmul.allow_fp16_reduced_precision_reduction,
                   cuda.matmul.allow_bf16_reduced_precision_reduction, torch.get_float32_matmul_precision()),
        "cudnn": (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "default_dtype": torch.get_default_dtype(),
        "threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "grad": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
        "dynamo": _plain(dynamo_config.get_config_copy()),
        "inductor": _plain(inductor_config.get_config_copy()),
        "attention_registry": {k: v for k, v in AttentionInterface._global_mapping.items() if k != ATTENTION_NAME},
    }
    return state


def _plain(config: dict[str, Any]) -> dict[str, str]:
    return {k: repr(v) for k, v in config.items()}


@contextlib.contextmanager
def unusual_settings() -> Iterator[None]:
    """Settings off their defaults for the test, restored after it."""
    cuda = torch.backends.cuda
    saved = (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled(), torch.get_float32_matmul_precision(),
             torch.get_num_threads(), torch.backends.cudnn.benchmark)
    cuda.enable_flash_sdp(False)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    torch.set_num_threads(1)
    try:
        yield
    finally:
        cuda.enable_flash_sdp(saved[0])
        cuda.enable_math_sdp(saved[1])
        torch.set_float32_matmul_precision(saved[2])
        torch.set_num_threads(saved[3])
        torch.backends.cudnn.benchmark = saved[4]


@pytest.mark.parametrize("name", sorted(_towers()))
def test_wrapping_capturing_and_calling_leave_global_state_alone(name):
    from tests.models.fixtures_families import FAMILIES

    if name in FAMILIES:
        FAMILIES[name].skip_if_unsupported()
    if name == "gemma4":
        skip_below("5.17", "the Gemma-4 adapter")
    tower = _towers()[name]()
    other = _towers()["qwen2_vl"]()  # another model of the process: its attention must stay its own
    other_attention = other.config._attn_implementation
    with unusual_settings():
        before = snapshot()
        fast = encgraph.graphed(tower, verify=False)
        encgraph.graphs(fast).capture()
        path, ladder = next(iter(encgraph.graphs(fast).runner.ladders.items()))
        # The smallest budget's size: Gemma-4's sample inputs of a few tokens fall outside the tiny tower's table.
        sample = encgraph.graphs(fast).runner.adapter.sample_inputs(path, min(b for b in ladder if b > 0))
        with torch.no_grad():
            encgraph.graphs(fast).runner(sample)
        after = snapshot()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if "dynamo" in changed or "inductor" in changed:  # name the keys, not the whole configs
        for k in ("dynamo", "inductor"):
            if k in changed:
                b, a = changed[k]
                changed[k] = {key: (b.get(key), a.get(key)) for key in set(b) | set(a) if b.get(key) != a.get(key)}
    assert not changed, changed
    assert other.config._attn_implementation == other_attention


@pytest.mark.parametrize("change", [
    lambda: torch.backends.cuda.enable_math_sdp(not torch.backends.cuda.math_sdp_enabled()),
    lambda: torch.set_float32_matmul_precision("medium"),
    lambda: torch.set_num_threads(max(1, torch.get_num_threads() - 1) if torch.get_num_threads() > 1 else 2),
    lambda: torch.set_default_dtype(torch.float64),
    lambda: setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit + 1),
    lambda: __import__("transformers").AttentionInterface.register("sdpa", lambda *a, **k: None),
], ids=["sdp flag", "matmul precision", "threads", "default dtype", "dynamo config", "registry entry"])
def test_the_snapshot_sees_each_kind_of_change(change):
    from transformers import AttentionInterface

    saved = (torch.backends.cuda.math_sdp_enabled(), torch.get_float32_matmul_precision(), torch.get_num_threads(),
             torch.get_default_dtype(), torch._dynamo.config.recompile_limit,
             AttentionInterface._global_mapping.get("sdpa"))
    before = snapshot()
    try:
        change()
        assert snapshot() != before
    finally:
        torch.backends.cuda.enable_math_sdp(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        torch.set_num_threads(saved[2])
        torch.set_default_dtype(saved[3])
        torch._dynamo.config.recompile_limit = saved[4]
        AttentionInterface._global_mapping["sdpa"] = saved[5]
    assert snapshot() == before
