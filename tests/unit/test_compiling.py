"""Compiling for capture (``encgraph.capture.compiling``), on the CPU: the regional compile of a tower's repeated
blocks traces without a graph break and with one graph per kind of block for every budget (Dynamo only:
``backend="eager"``, so the test needs no C++ compiler and takes seconds), the cache directory, the modes."""

from __future__ import annotations

import os

import pytest
import torch

from encgraph.capture.buffers import PathBuffers
from encgraph.capture.compiling import (
    RECOMPILE_HEADROOM,
    CompiledRegions,
    CompileMode,
    compile_cache,
    compile_stats,
    default_cache_dir,
    no_duck_sizing,
    recompile_headroom,
    resolve_compile,
)
from encgraph.errors import ConfigError, ConfigTypeError

pytest.importorskip("transformers")


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """The CUDA path of the packed attention (the VARLEN backend and its custom op), with a CPU kernel behind
    it: what torch.compile traces on a GPU."""
    import encgraph.models.attention as attention
    from encgraph.models import varlen_kernel
    from encgraph.models._varlen_op import make_op

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return attention.masked_attention(q, k, v, cu_q, kw.get("scale"))

    monkeypatch.setattr(attention, "pick_backend", lambda q: attention.AttentionBackend.VARLEN)
    monkeypatch.setattr(varlen_kernel, "_VARLEN", (kernel, True))
    from encgraph.models import _varlen_op

    previous = _varlen_op._IMPL
    monkeypatch.setattr(attention, "_VARLEN_OP", make_op(kernel, True))
    yield
    _varlen_op._IMPL = previous


def _qwen(family):
    from encgraph.models import wrap
    from tests.models.conftest import QWEN_TOWERS

    return wrap(QWEN_TOWERS[family](depth=4)), {"default": [64, 48, 32, 24]}, 4


def _gemma4():
    from encgraph.models import wrap
    from tests.models.fixtures_multipath import gemma4_tower

    options = {"frame_tokens": 4, "max_image_tokens": 16, "max_video_tokens": 8}
    return wrap(gemma4_tower(depth=3), **options), {"image": [16, 8], "video": [8, 4]}, 3


def _step3p7():
    from encgraph.models import wrap
    from tests.models.fixtures_multipath import STEP_LOCAL, step3p7_model

    adapter = wrap(step3p7_model(depth=3), max_images=4, max_tiles=4, local_size=STEP_LOCAL)
    return adapter, {"global": [64, 32, 16], "local": [36, 18, 9]}, 3


REGIONAL = {"qwen2_5_vl": lambda: _qwen("qwen2_5_vl"), "qwen3_vl": lambda: _qwen("qwen3_vl"), "gemma4": _gemma4,
            "step3p7": _step3p7}
"""Towers whose adapters name compile regions: (adapter, budgets per path, layers)."""


@pytest.mark.parametrize("family", sorted(REGIONAL))
def test_regional_compile_has_no_graph_break_and_serves_every_budget(family, varlen_on_cpu):
    import torch
    import torch._dynamo

    from tests.models.versions import skip_below

    if family in ("gemma4", "step3p7"):
        skip_below("5.17", f"the {family} adapter")
    torch._dynamo.reset()
    torch.manual_seed(0)
    adapter, ladders, layers = REGIONAL[family]()
    regions = CompiledRegions(adapter, backend="eager")
    assert len(regions.modules) == layers
    before = compile_stats()
    outs = {}
    with no_duck_sizing(), torch.no_grad():
        regions.compile()
        try:
            for path, budgets in ladders.items():
                specs = {b: adapter.buffer_specs(path, b, 4, 8) for b in budgets}
                buffers = PathBuffers(path, specs, torch.device("cpu"))
                for b in budgets:
                    views = buffers.fill(b, None)
                    for t in views.values():
                        if t.is_floating_point():
                            t.normal_()
                    outs[path, b] = (adapter.forward_static(path, views, b), {k: v.clone() for k, v in views.items()})
        finally:
            regions.restore()
        for (path, b), (out, views) in outs.items():  # the same static forward, uncompiled, on the same buffers
            ref = adapter.forward_static(path, views, b)
            for name in ref:
                torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5)
    after = compile_stats()
    assert after["graph_breaks"] == before["graph_breaks"], "a graph break inside a block: a graph per piece"
    # One graph per kind of block call (first block / the others; windowed / full attention), not per budget
    # or path.
    assert after["unique_graphs"] - before["unique_graphs"] <= 2
    assert after["recompiles"] == before["recompiles"]
    assert all(m._compiled_call_impl is None for m in regions.modules)  # the tower runs uncompiled again


def test_compile_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCGRAPH_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert default_cache_dir() == tmp_path / "mine"
    with compile_cache(None) as used:
        assert used == str(tmp_path / "mine") and os.environ["TORCHINDUCTOR_CACHE_DIR"] == used
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # put back as it was
    with compile_cache(tmp_path / "given") as used:
        assert used == str(tmp_path / "given")
    # The user's own TORCHINDUCTOR_CACHE_DIR wins; torch's default (which torch writes there itself) does not.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "user"))
    with compile_cache(None) as used:
        assert used == str(tmp_path / "user")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default())
    with compile_cache(None) as used:
        assert used == str(tmp_path / "mine")
    monkeypatch.delenv("ENCGRAPH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "encgraph" / "torch"


def test_resolve_compile():
    assert resolve_compile("auto", graph_mode=True) is CompileMode.AUTO
    assert resolve_compile("auto", graph_mode=False) is CompileMode.OFF  # nothing is captured there
    assert resolve_compile(True, graph_mode=True) is CompileMode.ON
    assert resolve_compile(False, graph_mode=True) is CompileMode.OFF
    with pytest.raises(ConfigError, match="GRAPH mode"):
        resolve_compile(True, graph_mode=False)
    with pytest.raises(ConfigTypeError, match="compile"):
        resolve_compile("fast", graph_mode=True)


def _shapes(fn, n):
    for size in range(1, n + 1):
        fn(torch.ones(size))


def test_compile_stats_count_frames_and_recompile_limit_hits():
    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def double(x):
        return x * 2

    before = compile_stats()
    with torch._dynamo.config.patch(recompile_limit=2):
        _shapes(double, 4)  # shapes 1 and 2 compile, 3 is over the limit: it runs uncompiled, and so does 4
    delta = {k: v - before[k] for k, v in compile_stats().items()}
    assert delta["frames_ok"] == 2 and delta["frames_total"] >= 3
    assert delta["recompile_limit"] >= 1


def test_recompile_headroom_raises_the_limit_for_the_block_only():
    from torch._dynamo import config as dynamo_config

    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def triple(x):
        return x * 3

    limit = dynamo_config.recompile_limit
    before = compile_stats()
    with torch._dynamo.config.patch(recompile_limit=8), recompile_headroom():
        assert dynamo_config.recompile_limit >= RECOMPILE_HEADROOM
        _shapes(triple, 12)  # 12 compilations of one code object: over torch's default 8, within the headroom
    delta = {k: v - before[k] for k, v in compile_stats().items()}
    assert delta["recompile_limit"] == 0 and delta["frames_ok"] == 12
    assert dynamo_config.recompile_limit == limit


def _vit_generic():
    from transformers import ViTConfig, ViTModel

    from encgraph.models.generic import GenericModuleAdapter

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       image_size=32, patch_size=8)
    module = ViTModel(config, add_pooling_layer=False).eval().requires_grad_(False)
    return GenericModuleAdapter.of_call(module, torch.randn(2, 3, 32, 32)), ["ViTLayer"] * 3


def _fixed(name):
    def build():
        from encgraph.models import wrap
        from tests.models import fixtures_fixed

        tower = getattr(fixtures_fixed, f"tiny_{name}")()
        return wrap(tower), [{"siglip": "SiglipEncoderLayer", "clip": "CLIPEncoderLayer",
                             "internvl": "InternVLVisionLayer"}[name]] * 2

    return build


BATCH_LADDERS = {"vit (generic)": _vit_generic, "siglip": _fixed("siglip"), "clip": _fixed("clip"),
                 "internvl": _fixed("internvl")}
"""Batch-ladder adapters (the any-module path and the fixed-resolution towers): (adapter, its regions' classes)."""


def run_budgets(adapter, regions, order, log=()):
    """The adapter's static forward at each budget of ``order`` (random inputs) through ``regions``, compiled for
    the calls: per call, the budget, its outputs, its inputs (cloned) and what ``log`` gained meanwhile (a set)."""
    path = adapter.config.paths[0].name
    specs = {b: adapter.buffer_specs(path, b, max(order), 1) for b in set(order)}
    buffers = PathBuffers(path, specs, torch.device("cpu"))
    done = []
    regions.compile()
    try:
        for b in order:
            views = buffers.fill(b, None)
            for t in views.values():
                if t.is_floating_point():
                    t.normal_()
            start = len(log)
            out = adapter.forward_static(path, views, b)
            done.append((b, out, {k: v.clone() for k, v in views.items()}, set(log[start:])))
    finally:
        regions.restore()
    return done


@pytest.mark.parametrize("name", sorted(BATCH_LADDERS))
def test_batch_ladders_compile_their_stack_once_for_every_batch(name):
    """A batch ladder compiles its layers with the batch alone symbolic from the first trace: one frame for every
    layer and budget, a batch of 1 first or later included (torch's automatic dynamic traced three: the first
    budget static, the batch symbolic, a batch of 1 again), and the same outputs as the uncompiled forward."""
    import torch._dynamo

    from encgraph.capture.compiling import Sizes

    torch._dynamo.reset()
    adapter, classes = BATCH_LADDERS[name]()
    regions = CompiledRegions(adapter, backend="eager")
    assert regions.dynamic is Sizes.BATCH
    assert [type(m).__name__ for m in regions.modules] == classes
    before = compile_stats()
    with no_duck_sizing(), torch.no_grad():
        done = run_budgets(adapter, regions, [1, 4, 2, 3, 1])
        after = compile_stats()
        for b, out, views, _ in done:
            ref = adapter.forward_static(adapter.config.paths[0].name, views, b)
            for key in ref:
                torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5)
    assert after["frames_ok"] - before["frames_ok"] == 1
    assert after["recompiles"] == before["recompiles"]
    assert after["graph_breaks"] == before["graph_breaks"]
    assert all(m._compiled_call_impl is None for m in regions.modules)
