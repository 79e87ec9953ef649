"""``encgraph.models.bicubic`` on the CPU: the weighted gather equals ``F.grid_sample``'s bicubic border sampling
on any table and any coordinates (outside the image too), and the GLM-4V rewrite equals the tower's own embedding
module on packed sequences of different shapes, in float32 and bfloat16, is applied by the GLM-4V adapter and undone
by ``unwrap()``, and brings no host data into the region a CUDA graph would capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from encgraph.models import wrap
from encgraph.models.bicubic import bicubic_border, cubic_weights, position_embedding_gather
from tests.models.fixtures_families import glm4v_moe_tower, glm4v_tower


def _grid_sample(table: torch.Tensor, height: int, width: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    image = table.T.reshape(1, -1, height, width)
    grid = torch.stack((x, y), dim=-1)[None, :, None, :]
    return F.grid_sample(image, grid, mode="bicubic", padding_mode="border", align_corners=False)[0, :, :, 0].T


@given(height=st.integers(1, 30), width=st.integers(1, 30), channels=st.integers(1, 9), points=st.integers(1, 60),
       seed=st.integers(0, 2**16))
def test_bicubic_border_equals_grid_sample(height, width, channels, points, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(height * width, channels, generator=gen, dtype=torch.float64)
    # Past the edges too (border padding), and the edges and pixel centres exactly.
    x = torch.rand(points, generator=gen, dtype=torch.float64) * 3 - 1.5
    y = torch.rand(points, generator=gen, dtype=torch.float64) * 3 - 1.5
    x[: min(points, 4)] = torch.tensor([-1.0, 1.0, 1 / width - 1, 0.0], dtype=torch.float64)[: min(points, 4)]
    got = bicubic_border(table, height, width, x, y)
    assert got.shape == (points, channels) and got.dtype == torch.float64
    torch.testing.assert_close(got, _grid_sample(table, height, width, x, y), rtol=1e-12, atol=1e-12)


def test_bicubic_border_float32_to_rounding():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(24 * 24, 64, generator=gen)
    x, y = (torch.rand(5000, generator=gen) * 2.6 - 1.3 for _ in range(2))
    want = _grid_sample(table, 24, 24, x, y)
    assert (bicubic_border(table, 24, 24, x, y) - want).abs().max() <= 2e-6 * want.abs().max()


def test_cubic_weights_sum_to_one_and_interpolate():
    t = torch.linspace(0, 1, 101, dtype=torch.float64)[:-1]
    w = cubic_weights(t)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(t))
    torch.testing.assert_close(cubic_weights(torch.zeros(1, dtype=torch.float64))[0],
                               torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def _packed(shapes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lengths, image_shapes (t, h, w), h_coords, w_coords)`` of frames of these ``(h, w)`` patch grids, packed."""
    h = torch.cat([torch.arange(a).repeat_interleave(b) for a, b in shapes])
    w = torch.cat([torch.arange(b).repeat(a) for a, b in shapes])
    lengths = torch.tensor([a * b for a, b in shapes])
    return lengths, torch.tensor([(1, a, b) for a, b in shapes]), h, w


@pytest.mark.parametrize("make", [glm4v_tower, glm4v_moe_tower], ids=["glm4v", "glm4v_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewrite_equals_the_towers_embedding(make, dtype):
    torch.manual_seed(0)
    embeddings = make().embeddings.to(dtype)
    with torch.no_grad():  # a table of the real one's spread (the fixture's is initialised near zero)
        embeddings.position_embedding.weight.normal_()
    lengths, shapes, h, w = _packed([(4, 6), (9, 2), (1, 1), (12, 12)])
    hidden = torch.randn(int(lengths.sum()), embeddings.embed_dim, dtype=dtype)
    want = embeddings(hidden, lengths, shapes, h, w)
    patch = position_embedding_gather(embeddings)
    assert patch is not None and "forward" not in embeddings.__dict__  # engaged only by the adapter's forwards
    patch.engage()
    got = embeddings(hidden, lengths, shapes, h, w)
    got_list = embeddings(hidden, lengths.tolist(), shapes, h, w)  # the tower also passes a list
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))
    else:  # the float32 embedding rounded once to bf16, as the tower rounds it: at most one ulp apart
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got_list, got, rtol=0, atol=0)
    patch.restore()
    assert "forward" not in embeddings.__dict__
    torch.testing.assert_close(embeddings(hidden, lengths, shapes, h, w), want, rtol=0, atol=0)


def test_other_modules_are_left_alone():
    assert position_embedding_gather(torch.nn.Identity()) is None
    embeddings = glm4v_tower().embeddings
    embeddings.interpolated_method = "bilinear"
    assert position_embedding_gather(embeddings) is None and "forward" not in embeddings.__dict__


def test_glm_adapter_applies_it_and_unwrap_restores():
    tower = glm4v_tower()
    adapter = wrap(tower)
    assert f"{type(tower.embeddings).__name__}: bicubic position embedding as one weighted gather" in adapter.layout
    adapter.unwrap()
    assert all("forward" not in m.__dict__ for m in tower.modules())


class _HostData(TorchDispatchMode):
    """Records every op that copies a CPU tensor of more than one element onto another device, and (through
    ``monkeypatch``) every ``torch.tensor`` / ``torch.as_tensor`` of host data made on another device (those copy
    inside the factory, where no dispatch mode sees them). On CUDA both copy from the host, which a CUDA graph
    cannot capture; ``meta`` stands in for the GPU here."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.seen: list[str] = []
        for name in ("tensor", "as_tensor"):
            factory = getattr(torch, name)

            def watched(*args, _factory=factory, _name=name, **kwargs):
                out = _factory(*args, **kwargs)
                if out.device.type != "cpu":
                    self.seen.append(f"torch.{_name}")
                return out

            monkeypatch.setattr(torch, name, watched)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.numel() > 1 for t in inputs) and any(
                t.device.type == "meta" for t in outputs):
            self.seen.append(str(func))
        return out


def test_the_rewrite_copies_nothing_from_the_host(monkeypatch):
    """Everything the rewritten forward reads is made on the tensors' device (what failed capture on the H200 in
    a first version: a host tuple of offsets made into a device tensor)."""
    with torch.device("meta"):
        embeddings = glm4v_tower().embeddings
        lengths, shapes, h, w = (t.to("meta") for t in _packed([(4, 6), (2, 2)]))
        hidden = torch.empty(28, embeddings.embed_dim)
    position_embedding_gather(embeddings)
    with monkeypatch.context() as patched, _HostData(patched) as mode:
        out = embeddings(hidden, lengths, shapes, h, w)
    assert out.shape == (28, embeddings.embed_dim) and mode.seen == []
    # the check itself: host data made into a device tensor, or copied there, is seen
    for make in (lambda: torch.tensor([1, 2, 3], device="meta"), lambda: torch.arange(3).to("meta")):
        with monkeypatch.context() as patched, _HostData(patched) as mode:
            make()
        assert mode.seen
