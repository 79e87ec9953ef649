"""The embeddings answer's JSON text (encgraph.serving.protocol.answer): the documented shape, every float32 read
back exactly, each number a JSON float, non-finite values refused as json.dumps refuses them."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("fastapi")

from encgraph.serving.protocol import EmbeddingRequest, answer


class _Model:
    name = "siglip-\u00e9"  # a name JSON must escape or carry as is

    def __init__(self, pooled: list[np.ndarray], tokens: list[np.ndarray]) -> None:
        self.pooled, self.tokens = pooled, tokens

    def embeddings(self, results, tokens):
        return [(p, t if tokens else None) for p, t in zip(self.pooled, self.tokens)]

    def token_count(self, results):
        return sum(t.shape[0] for t in self.tokens)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _json_floats(values: np.ndarray) -> str:
    """The JSON text of ``values`` as a float answer's embedding, read out of the whole answer's text."""
    body = answer(_Model([values], [values]), [], EmbeddingRequest(input=["a"], encoding_format="float")).body
    text = body.decode()
    start = text.index('"embedding":') + len('"embedding":')
    return text[start : text.index(',"tokens"') if ',"tokens"' in text else text.rindex("}],")]


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=9), elements=finite32))
def test_every_float32_reads_back_exactly_and_as_a_json_float(values):
    text = _json_floats(values)
    back = json.loads(text)
    assert np.array_equal(np.asarray(back, dtype=np.float32).reshape(values.shape), values)
    flat = [x for row in back for x in row] if values.ndim == 2 else back
    assert all(isinstance(x, float) for x in flat)  # 10.0, never 10: a reader must not get integers
    # The sign of zero survives too.
    assert np.array_equal(np.signbit(np.asarray(back, dtype=np.float32).reshape(values.shape)), np.signbit(values))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_as_json_dumps_refuses_them(bad):
    with pytest.raises(ValueError, match="no JSON number"):
        _json_floats(np.array([0.5, bad], np.float32))
    with pytest.raises(ValueError):  # what the answer did before: JSONResponse's json.dumps(allow_nan=False)
        json.dumps([0.5, float(bad)], allow_nan=False)


@pytest.mark.parametrize("fmt", ["float", "base64"])
@pytest.mark.parametrize("tokens", [False, True])
def test_the_answer_has_the_documented_shape_in_input_order(fmt, tokens):
    rng = np.random.default_rng(0)
    pooled = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    pooled[1][2] = 4.0  # an integral value among them
    seqs = [rng.standard_normal((n, 6)).astype(np.float32) for n in (2, 5, 1)]
    model = _Model(pooled, seqs)
    req = EmbeddingRequest(input=["a", "b", "c"], return_tokens=tokens, encoding_format=fmt)
    response = answer(model, [], req)
    assert response.media_type == "application/json"
    got = json.loads(response.body)
    assert list(got) == ["object", "model", "data", "usage"]
    assert got["object"] == "list" and got["model"] == model.name
    assert got["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    assert [d["index"] for d in got["data"]] == [0, 1, 2]

    def decode(value, shape):
        if fmt == "base64":
            return np.frombuffer(base64.b64decode(value), "<f4").reshape(shape)
        return np.asarray(value, dtype=np.float32).reshape(shape)

    for d, p, t in zip(got["data"], pooled, seqs):
        assert d["object"] == "embedding"
        assert np.array_equal(decode(d["embedding"], p.shape), p)
        if tokens:
            assert d["tokens_shape"] == list(t.shape)
            assert np.array_equal(decode(d["tokens"], t.shape), t)
        else:
            assert "tokens" not in d and "tokens_shape" not in d
