"""What the DeepSeek-OCR2 adapter (:mod:`encgraph.models.deepseek_ocr2`) knows of the model's vision tower
(``DeepseekOcr2VisionModel``: a SAM encoder, then a query encoder): the tokens and side of a view, and a
capturable form of the SAM attention's relative-position lookup. Step-3.7's tower has the same SAM geometry.
"""

from __future__ import annotations

import torch

from encgraph.capture.grad import persistent

__all__ = ["sam_grid", "view_tokens", "default_side", "graph_safe_rel_pos"]


def sam_grid(side: int, patch: int) -> int:
    """Patches a side of a ``side x side`` view after a SAM-style encoder: the patch convolution floors, then
    its projection's two stride-2 convolutions (kernel 3, padding 1) give ``ceil(n / 2)`` each."""
    n = side // patch
    for _ in range(2):
        n = (n - 1) // 2 + 1
    return n


def view_tokens(tower: torch.nn.Module, side: int) -> int:
    """Output tokens of one ``side x side`` view through ``tower`` (a ``DeepseekOcr2VisionModel``): the count of
    the learnable queries it picks, which the tower chooses by the SAM output's patch count (``<= 144``: the
    768 px queries, else the 1024 px ones)."""
    sam = tower.config.sam_config
    patch = sam.patch_size if isinstance(sam.patch_size, int) else sam.patch_size[0]
    patches = sam_grid(side, patch) ** 2
    small, large = tower.query_768_resolution.num_embeddings, tower.query_1024_resolution.num_embeddings
    # The tower compares with the literal 144, the size of its 768 px query table.
    return small if patches <= small else large


def default_side(tower: torch.nn.Module, queries: int) -> int:
    """The side in pixels of a view of ``queries`` tokens: its SAM grid, downsampled 4x, is the query grid
    (16 x 16 queries at patch 16 -> 1024 px)."""
    sam = tower.config.sam_config
    patch = sam.patch_size if isinstance(sam.patch_size, int) else sam.patch_size[0]
    return round(queries**0.5) * 4 * patch


def graph_safe_rel_pos(tower: torch.nn.Module) -> None:
    """Make the SAM attention layers' relative-position lookup capturable.

    transformers' ``get_rel_pos`` indexes the (device) table with coordinates built by ``torch.arange`` on the
    host, a host-to-device copy that a CUDA graph capture refuses. This instance-level override computes the same
    lookup with the coordinates cached on the table's device (built on the first, uncaptured warm-up call; one
    per query/key size). Idempotent; the class's own method is untouched.
    """
    for module in tower.modules():
        original = getattr(type(module), "get_rel_pos", None)
        if original is None or "get_rel_pos" in vars(module):
            continue
        cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}

        def get_rel_pos(q_size: int, k_size: int, rel_pos: torch.Tensor, _cache: dict = cache) -> torch.Tensor:
            max_rel_dist = int(2 * max(q_size, k_size) - 1)
            resized = torch.nn.functional.interpolate(
                rel_pos.reshape(1, rel_pos.shape[0], -1).transpose(1, 2), size=max_rel_dist, mode="linear"
            ).reshape(-1, max_rel_dist).permute(1, 0)
            key = (q_size, k_size, rel_pos.device)
            index = _cache.get(key)
            if index is None:
                with persistent():  # cached across calls: never an inference tensor
                    q = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
                    k = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
                    index = (q - k) + (k_size - 1) * max(q_size / k_size, 1.0)
                    index = _cache[key] = index.long().to(rel_pos.device)
            return resized[index]

        module.get_rel_pos = get_rel_pos

