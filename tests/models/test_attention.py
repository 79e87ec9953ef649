"""encgraph.models.attention and encgraph.models._hf: packed attention on the padded layout, its Hugging Face
registration, the reversible attention switch and the version guard."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import encgraph
from encgraph.models import _hf, attention, sequence_bounds, varlen_kernel
from encgraph.models.attention import (
    ATTENTION_NAME,
    MIN_TRANSFORMERS,
    AttentionBackend,
    hf_attention_forward,
    packed_attention,
    pick_backend,
    register_attention,
    use_packed_attention,
)


def reference(q, k, v, lengths, scale=None):
    """Per-sequence SDPA on (tokens, heads, dim) tensors."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(*(t[sl].transpose(0, 1)[None] for t in (q, k, v)), scale=scale)
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def qkv(tokens, heads=3, dim=8, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads or heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads or heads, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_masked_equals_per_sequence_with_zero_length_slots(cu_dtype):
    lengths = [5, 1, 9, 3]
    q, k, v = qkv(sum(lengths))
    # Trailing zero-length sequences: a buffer with more slots than sequences.
    cu = torch.tensor([0, 5, 6, 15, 18, 18, 18], dtype=cu_dtype)
    out = packed_attention(q, k, v, cu, 18, scale=0.3)
    torch.testing.assert_close(out, reference(q, k, v, lengths, scale=0.3), rtol=1e-6, atol=1e-6)
    assert out.shape == q.shape


def test_masked_grouped_kv_heads():
    q, k, v = qkv(7, heads=4, kv_heads=2)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, 4)
    ref = reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), [3, 4])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_backend_choice():
    # The CPU runs each sequence alone (isolated, no tokens^2 mask); a capturable mask elsewhere off varlen.
    assert pick_backend(torch.zeros(2, 1, 4)) is AttentionBackend.SEGMENTS
    assert pick_backend(torch.zeros(2, 1, 4, dtype=torch.bfloat16)) is AttentionBackend.SEGMENTS
    assert pick_backend(torch.zeros(2, 1, 4, device="meta")) is AttentionBackend.MASKED_SDPA


@pytest.mark.parametrize("backend", [AttentionBackend.SEGMENTS, AttentionBackend.MASKED_SDPA])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf"), 1e30])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_one_sequence_never_reaches_another(backend, poison, where):
    # Rule 13: a bad value in one sequence (an image) leaves every other sequence's rows exactly as they are
    # without it. (Inside its own sequence a non-finite value is the kernel's business, as in the tower.)
    q, k, v = qkv(20, heads=2)
    cu = torch.tensor([0, 5, 12, 20, 20], dtype=torch.int32)
    clean = packed_attention(q, k, v, cu, 8, backend=backend)
    tensors = {"query": q.clone(), "key": k.clone(), "value": v.clone()}
    tensors[where][7] = poison
    out = packed_attention(tensors["query"], tensors["key"], tensors["value"], cu, 8, backend=backend)
    others = torch.cat([torch.arange(0, 5), torch.arange(12, 20)])
    torch.testing.assert_close(out[others], clean[others], rtol=1e-5, atol=1e-5)
    if where != "query" and poison != 1e30:
        assert not bool(torch.isfinite(out[5:12]).all())  # the poisoned sequence is not silently cleaned


def test_segments_need_no_tokens_squared_memory():
    # One 12,000-row padding sequence: (tokens, tokens) float scores alone would be 576 MB; the CPU backend runs
    # torch's flash kernel per sequence. Peak memory of a fresh process, so earlier tests do not count.
    import subprocess

    code = (
        "import resource, torch; from encgraph.models.attention import packed_attention, AttentionBackend as B; "
        "torch.set_num_threads(1); q = torch.randn(12000, 1, 8); base = resource.getrusage(resource.RUSAGE_SELF)"
        ".ru_maxrss; out = packed_attention(q, q, q, torch.tensor([0, 10, 12000], dtype=torch.int32), 12000, "
        "backend=B.SEGMENTS); assert bool(torch.isfinite(out).all()); "
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 200, f"peak grew by {done.stdout.split()[-1]} MB"


@pytest.mark.parametrize("takes_scale", [True, False])
def test_varlen_call_contract(monkeypatch, takes_scale):
    # The varlen kernel itself needs CUDA (tests/gpu); here: what it is handed.
    calls = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append((cu_q.dtype, cu_q is cu_k, max_q, max_k, kw))
        lengths = torch.diff(cu_q).tolist()
        return reference(q, k, v, [n for n in lengths if n], scale=kw.get("scale"))

    monkeypatch.setattr(varlen_kernel, "torch_varlen", lambda: (fake, takes_scale))
    q, k, v = qkv(6, dim=16)
    cu = torch.tensor([0, 2, 6, 6], dtype=torch.int64)
    out = packed_attention(q, k, v, cu, 64, scale=0.5, backend=AttentionBackend.VARLEN)
    torch.testing.assert_close(out, reference(q, k, v, [2, 4], scale=0.5), rtol=1e-5, atol=1e-5)
    dtype, same, max_q, max_k, kw = calls[0]
    assert dtype == torch.int32 and same and max_q == max_k == 64
    assert ("scale" in kw) == takes_scale  # torch 2.10 has no scale: it is folded into the query
    packed_attention(q, k, v, cu, 64, scale=16**-0.5, backend=AttentionBackend.VARLEN)
    assert "scale" not in calls[-1][4]  # the default scale is never passed
    # The compiled path's op (_varlen_call) hands the kernel the same: one dispatch for both.
    cu32 = cu.to(torch.int32)
    got = attention._varlen_call(q, k, v, cu32, cu32, 64, 64, 0.5)
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    assert ("scale" in calls[-1][4]) == takes_scale
    attention._varlen_call(q, k, v, cu32, cu32, 64, 64, 16**-0.5)
    assert "scale" not in calls[-1][4]


def test_masked_attention_has_no_host_sync():
    # Meta tensors have no data: any .item()/.tolist()/nonzero would raise. This is what capture needs.
    q, k, v = (torch.empty(12, 2, 8, device="meta") for _ in range(3))
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    assert packed_attention(q, k, v, cu, 12).shape == (12, 2, 8)


@pytest.mark.parametrize(
    "max_seqlen, match", [(torch.tensor(4), "host int"), (0, "host int"), (True, "host int")]
)
def test_bad_max_seqlen(max_seqlen, match):
    q, k, v = qkv(4)
    with pytest.raises(encgraph.InputError, match=match):
        packed_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32), max_seqlen)


def test_bad_shapes_and_cu():
    q, k, v = qkv(4)
    with pytest.raises(encgraph.InputError, match="tokens, heads, head_dim"):
        packed_attention(q[None], k, v, torch.tensor([0, 4], dtype=torch.int32), 4)
    with pytest.raises(encgraph.InputError, match="int32"):
        packed_attention(q, k, v, torch.tensor([0.0, 4.0]), 4)
    with pytest.raises(encgraph.InputError, match="multiple"):
        packed_attention(*qkv(4, heads=3, kv_heads=2), torch.tensor([0, 4], dtype=torch.int32), 4)


def test_hf_signature_packed_and_plain():
    q, k, v = qkv(9)
    hq, hk, hv = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, dim) as transformers passes
    cu = torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    out, weights = hf_attention_forward(
        None, hq, hk, hv, None, scaling=0.25, dropout=0.0,
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9, is_causal=False,
    )
    assert weights is None and out.shape == (1, 9, 3, 8)
    torch.testing.assert_close(out[0], reference(q, k, v, [4, 5], scale=0.25), rtol=1e-6, atol=1e-6)
    # max_length_q missing (an eager caller): read from cu_seqlens.
    out2, _ = hf_attention_forward(None, hq, hk, hv, None, scaling=0.25, cu_seq_lens_q=cu)
    torch.testing.assert_close(out2, out)
    # No cu_seq_lens: a module that does not pack gets plain SDPA.
    plain, _ = hf_attention_forward(None, hq, hk, hv, None, scaling=0.25)
    torch.testing.assert_close(plain[0], reference(q, k, v, [9], scale=0.25), rtol=1e-6, atol=1e-6)


def test_hf_signature_rejects_what_it_cannot_do():
    hq = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(encgraph.ConfigError, match="dropout"):
        hf_attention_forward(None, hq, hq, hq, None, dropout=0.1, cu_seq_lens_q=cu)
    with pytest.raises(encgraph.ConfigError, match="causal"):
        hf_attention_forward(None, hq, hq, hq, None, cu_seq_lens_q=cu, is_causal=True)
    with pytest.raises(encgraph.ConfigError, match="self-attention"):
        hf_attention_forward(None, hq, hq, hq, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())


def test_registration_is_idempotent_and_flash_named():
    from transformers import AttentionInterface
    from transformers.utils.generic import is_flash_attention_requested

    assert register_attention() == register_attention() == ATTENTION_NAME
    assert AttentionInterface()[ATTENTION_NAME] is hf_attention_forward
    # The towers' packed path hinges on this test of the name.
    assert is_flash_attention_requested(requested_attention_implementation=ATTENTION_NAME)


def test_switch_is_reversible_covers_copied_configs_and_never_mutates_them(qwen_towers):
    torch.manual_seed(0)
    tower = qwen_towers["qwen2_5_vl"]()
    # A block holding its own copy of the config must be switched too.
    import copy

    own = tower.blocks[0].attn.config = copy.deepcopy(tower.config)
    shared = tower.config
    before = tower.config._attn_implementation
    switch = use_packed_attention(tower)
    # The caller's config objects are untouched (a second model can be built from them while wrapped) ...
    assert tower.config is shared and shared._attn_implementation == before and own._attn_implementation == before
    type(tower)._from_config(tower.config)
    # ... while every attention module reads the packed implementation from a private copy.
    attns = [b.attn for b in tower.blocks]
    assert all(a.config._attn_implementation == ATTENTION_NAME for a in attns)
    assert attns[1].config is attns[2].config and attns[0].config is not attns[1].config
    switch.disengage()  # between an adapter's own forwards: the tower's own configs
    assert attns[0].config is own and attns[1].config is shared
    with switch.engaged():
        assert attns[0].config._attn_implementation == ATTENTION_NAME
    assert attns[0].config is own
    switch.restore()
    switch.restore()  # idempotent
    assert attns[0].config is own and attns[1].config is shared and shared._attn_implementation == before


def test_version_guard(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.14.2")
    with pytest.raises(encgraph.VersionError, match=rf"transformers>={MIN_TRANSFORMERS}, found 5.14.2"):
        register_attention()
    monkeypatch.setattr(transformers, "__version__", "5.15.0.dev0")
    assert register_attention() == ATTENTION_NAME
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(encgraph.VersionError, match="not installed"):
        _hf.require_transformers("5.15", "x")
    assert isinstance(encgraph.VersionError("x"), ImportError)


def test_tower_dtype_device():
    lin = torch.nn.Linear(2, 2).to(torch.float64)
    assert _hf.tower_dtype_device(lin) == (torch.float64, torch.device("cpu"))
    assert _hf.tower_dtype_device(torch.nn.ReLU()) == (torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------- host bounds
def segment_spy(monkeypatch) -> list[bool]:
    """Records, per SEGMENTS call, whether it got its bounds from the host (``host_bounds``)."""
    calls: list[bool] = []
    original = attention.segment_attention

    def spy(q, k, v, cu, scale, bounds=None):
        calls.append(bounds is not None)
        return original(q, k, v, cu, scale, bounds)

    monkeypatch.setattr(attention, "segment_attention", spy)
    return calls


def test_host_bounds_run_every_sequence_on_its_own_on_the_cpu(monkeypatch):
    calls = segment_spy(monkeypatch)
    q, k, v = qkv(40)
    cu = torch.tensor([0, 24, 40, 40], dtype=torch.int32)
    plain = packed_attention(q, k, v, cu, 24)
    with attention.host_bounds([(cu, [0, 24, 40, 40])], min_rows={(3, 8, torch.float32): 10**6}):
        got = packed_attention(q, k, v, cu, 24)  # the CPU: no varlen kernel to choose, whatever the table says
        other = cu.clone()
        unknown = packed_attention(q, k, v, other, 24)  # another tensor: its bounds are not known
    packed_attention(q, k, v, cu, 24)  # outside the block
    assert torch.equal(got, plain) and torch.equal(unknown, plain)
    assert calls == [False, True, False, False]
    assert torch.equal(got, reference(q, k, v, [24, 16]))
    assert sequence_bounds._HOST_BOUNDS.get() is None  # the block restores the context


def test_host_bounds_never_apply_while_compiling(monkeypatch):
    cu = torch.tensor([0, 40], dtype=torch.int32)
    q = torch.zeros(40, 2, 8)
    with attention.host_bounds([(cu, [0, 40])]):
        assert attention._host_plan(cu, q) == ((0, 40), None)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert attention._host_plan(cu, q) is None


def _eager_towers() -> dict[str, Callable[[], torch.nn.Module]]:
    from tests.models import conftest as qwen
    from tests.models.fixtures_families import FAMILIES

    towers = {"qwen2_vl": qwen.qwen2_vl_tower, "qwen2_5_vl": qwen.qwen2_5_vl_tower, "qwen3_vl": qwen.qwen3_vl_tower}
    towers.update((name, f.tower) for name, f in FAMILIES.items() if f.tower_tests)
    return towers


@pytest.mark.parametrize("name", sorted(_eager_towers()))
def test_eager_forwards_give_their_full_attention_layers_host_bounds(name, monkeypatch):
    """Every packed-grid adapter's eager forward hands its full-attention bounds from the host (so on CUDA its
    long images attend with one dense call each); the result is the same as reading them from the device."""
    from encgraph.models import wrap
    from tests.models.fixtures_families import FAMILIES

    if name in FAMILIES:
        FAMILIES[name].skip_if_unsupported()
    adapter = wrap(_eager_towers()[name]())
    inputs = adapter.sample_inputs("default", 64)
    with torch.no_grad():
        before = adapter.forward_eager("default", inputs)
    calls = segment_spy(monkeypatch)
    monkeypatch.setattr(attention, "SEGMENT_MIN_ROWS", 1)
    with torch.no_grad():
        after = adapter.forward_eager("default", inputs)
    assert any(calls), calls  # at least the full-attention layers (Qwen2.5-VL's window layers keep the tensor)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
