"""``encgraph::varlen_attn``: torch's ``varlen_attn`` as an opaque custom op for ``torch.compile``.

Dynamo then never traces into torch's Python wrapper of the flash kernel (whose checks and helpers differ
between torch releases and broke the graph on torch 2.11: 9 graph breaks and 16 graphs for one tower, where
the same forward without it compiles to one graph); inductor sees one op with a fake (shape-only) kernel.
Imported (and the op registered) on first use only, by :mod:`encgraph.models.attention`.

No ``from __future__ import annotations`` here: ``torch.library.custom_op`` reads the real annotations.
"""

from typing import Callable, Optional

import torch

__all__ = ["make_op"]

_OP: Optional[Callable[..., torch.Tensor]] = None
_IMPL: tuple = (None, False)  # (varlen_attn, takes_scale): what the op calls, set by make_op


def make_op(varlen_attn: Callable[..., torch.Tensor], takes_scale: bool) -> Callable[..., torch.Tensor]:
    """The op calling ``varlen_attn``; same positional signature, plus ``scale``. A name is registered once per
    process: later calls keep that op and point it at the ``varlen_attn`` given last."""
    global _OP, _IMPL
    _IMPL = (varlen_attn, takes_scale)
    if _OP is not None:
        return _OP

    @torch.library.custom_op("encgraph::varlen_attn", mutates_args=())
    def varlen_op(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: Optional[float] = None,
    ) -> torch.Tensor:
        impl, scaled = _IMPL
        kwargs = {"scale": scale} if scale is not None and scaled else {}
        return impl(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    @varlen_op.register_fake
    def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)

    _OP = varlen_op
    return _OP
