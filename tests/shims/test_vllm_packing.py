"""vLLM 0.33's packing rule (budget-cliff deferral) and the shim's choice of plan; pure, no vLLM, no torch.

The named cases are vLLM's own ``TestExecuteLocalPacking`` scenarios (``tests/v1/cudagraph/
test_encoder_cudagraph.py``), here through encgraph's public planner types.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from encgraph.packing import EagerReason, ItemSpec, pack
from encgraph.shims._vllm_packing import fewer_padded, padded_tokens, vllm_plan
from tests.strategies import problems


def runs(plan):
    """(items, path, budget) per replay, in plan order, as vLLM's tests list them."""
    return [(list(b.items), p, v) for b in plan.batches for p, v in b.budgets.items() if v]


def both(tokens, ladder, *, max_items=16, max_frames=None):
    specs = [ItemSpec(t) for t in tokens]
    frames = max_frames or max_items * 4
    greedy = pack(specs, ladder, max_items=max_items, max_frames=frames)
    theirs = vllm_plan(specs, {"default": ladder}, max_items=max_items, max_frames=frames)
    return greedy, theirs, fewer_padded(greedy, theirs)


@pytest.mark.parametrize("tokens,ladder,want,greedy_pads_more", [
    ([4000, 200], (256, 4096, 8192), [([1], "default", 256), ([0], "default", 4096)], True),  # cliff deferral
    ([4000, 4000], (256, 4096, 8192), [([0, 1], "default", 8192)], False),  # a tie does not defer
    ([1366] * 3, (256, 2048, 4096, 8192), [([0, 1, 2], "default", 8192)], False),  # item must outweigh the batch
    ([100, 100], (256, 4096), [([0, 1], "default", 256)], False),  # no cliff: unchanged
    ([100] * 4, (256, 4096), [([0, 1], "default", 256), ([2, 3], "default", 256)], True),  # small items split
])
def test_vllms_packing_scenarios(tokens, ladder, want, greedy_pads_more):
    greedy, theirs, chosen = both(tokens, ladder)
    assert runs(theirs) == want
    assert runs(chosen) == want  # the shim never pads more than vLLM's manager
    assert (padded_tokens(greedy) > padded_tokens(theirs)) is greedy_pads_more


def test_max_batch_size_and_oversized_items():
    _, theirs, _ = both([100] * 4, (1024, 4096), max_items=3)
    assert runs(theirs) == [([0, 1, 2], "default", 1024), ([3], "default", 1024)]
    _, theirs, chosen = both([100, 9000], (256, 4096))
    assert runs(theirs) == [([0], "default", 256)] and chosen.eager_items() == 1


def test_two_paths_defer_on_one_and_skip_zero_token_paths():
    ladders = {"a": (0, 256, 4096, 8192), "b": (256, 4096, 8192)}
    specs = [ItemSpec({"a": 200, "b": 100}, input_size=300), ItemSpec({"a": 0, "b": 4000}, input_size=4000)]
    theirs = vllm_plan(specs, ladders, max_items=16, max_frames=16, order=[300, 4000])
    want = [([0], "a", 256), ([0], "b", 256), ([1], "b", 4096)]
    assert runs(theirs) == want
    greedy = pack(specs, ladders, max_items=16, max_frames=16)
    assert runs(greedy) == [([0, 1], "a", 256), ([0, 1], "b", 8192)]  # encgraph's greedy pads more here
    assert runs(fewer_padded(greedy, theirs)) == want


def test_frames_split_videos_but_images_fill_the_item_limit():
    images = [ItemSpec(4)] * 4
    assert [b.items for b in vllm_plan(images, {"default": (16, 64)}, max_items=4, max_frames=4).batches] == [(0, 1, 2, 3)]
    videos = [ItemSpec(8, frames=2)] * 3 + [ItemSpec(4, frames=5)]
    plan = vllm_plan(videos, {"default": (16, 64)}, max_items=4, max_frames=4)
    assert all(b.frames <= 4 for b in plan.batches if not b.eager)
    assert [(b.items, b.eager) for b in plan.batches if b.eager] == [((3,), {"default": EagerReason.FRAMES})]


@given(problems(max_size=30))
def test_vllm_plan_is_a_valid_plan_and_the_choice_never_pads_more(problem):
    lads = problem.ladders if isinstance(problem.ladders, dict) else {"default": problem.ladders}
    frames = problem.max_frames or problem.max_items * 6
    theirs = vllm_plan(problem.items, lads, max_items=problem.max_items, max_frames=frames)
    placed = sorted(i for b in theirs.batches for i in b.items)
    assert placed == list(range(len(problem.items)))
    for b in theirs.batches:
        if len(b.items) > 1:
            assert len(b.items) <= problem.max_items and b.frames <= frames
            assert all(v is not None for v in b.budgets.values())
    ours = pack(problem.items, lads, max_items=problem.max_items, max_frames=frames)
    chosen = fewer_padded(ours, theirs)
    assert padded_tokens(chosen) <= min(padded_tokens(ours), padded_tokens(theirs))
