"""encgraph.models.call_args: how the model adapters bind a tower call and read its switches."""

from __future__ import annotations

import types

import pytest

from encgraph.errors import EncgraphError
from encgraph.models.call_args import bind, recording_requested, return_dict, switch


def test_bind_takes_positions_then_keywords_and_leaves_the_rest():
    kwargs = {"image_sizes": [(2, 3)], "return_dict": False}
    values = bind("T.forward", ("pixel_values", "image_sizes"), ("px",), kwargs)
    assert values == {"pixel_values": "px", "image_sizes": [(2, 3)]} and kwargs == {"return_dict": False}
    assert bind("T.forward", ("a", "b", "c"), (), {}) == {}


@pytest.mark.parametrize("args, kwargs, message", [
    ((1, 2, 3), {}, r"T.forward: expected \(a, b\), got 3 positional arguments"),
    ((1,), {"a": 2}, r"T.forward: got 'a' both positionally and by keyword"),
])
def test_bind_refuses_what_the_tower_would(args, kwargs, message):
    with pytest.raises(EncgraphError, match=message) as caught:
        bind("T.forward", ("a", "b"), args, kwargs)
    assert isinstance(caught.value, TypeError)


def test_switches_follow_the_call_then_the_config():
    config = types.SimpleNamespace(output_attentions=False, output_hidden_states=True, return_dict=False)
    assert switch(config, {}, "output_hidden_states") is True
    assert switch(config, {"output_hidden_states": None}, "output_hidden_states") is True  # None: the config's
    assert switch(config, {"output_hidden_states": False}, "output_hidden_states") is False
    assert switch(None, {}, "use_cache", default=3) == 3
    assert recording_requested(config, {}) == "output_hidden_states"
    assert recording_requested(config, {"output_hidden_states": False}) is None
    assert recording_requested(None, {"output_attentions": True}) == "output_attentions"
    assert return_dict(config, {}) is False and return_dict(None, {}) is True
    assert return_dict(config, {"return_dict": "yes"}) == "yes"  # as given: the adapter checks it
