"""Exact, reversible rewrites of a tower's layers that let the GPU run their matmuls on its fast kernels.

Measured on an H200 (``benches/kernel_profile.py``, Qwen2.5-VL-7B tower, bf16; results in
``benches/results/kernel_profile_nvidia-h200*.md``):

- **Patch embedding as one matmul.** The Qwen-VL towers embed patches with a ``Conv3d`` whose stride is its kernel:
  each output is a dot product of one flattened patch row with a filter, i.e. ``F.linear`` of the rows the
  processor already flattened. cuDNN runs it as ``implicit_convolveNd_sgemm``: 0.24 ms for 256 rows and 0.58 ms
  for 4096, against 0.035 and 0.04 ms for the linear (:func:`linear_patch_embed`).
- **Gated MLP padded to an aligned width.** Qwen2.5-VL's intermediate size is 3420, not a multiple of 8: rows of
  the MLP activations and of ``down_proj``'s weight are not 16-byte aligned, so cuBLAS cannot use its Hopper
  (TMA) kernels and falls back to ``cutlass_80 ... align2`` kernels, 2.3 of 2.8 ms of matmul per 224 px image
  and 17 of 20 ms at 4096 patch rows. :func:`align_gated_mlp` pads the intermediate size with zero weights to the
  next multiple of 8 and fuses ``gate_proj`` and ``up_proj`` into one matmul; the padded columns are exactly
  zero (``act(0 + 0) * 0``, times zero weights), so the result is the same sum, in another kernel's order.

Each rewrite returns a :class:`LayoutPatch` holding an instance ``forward`` for the submodule (the class is
untouched), set only while the adapter's own forwards run (:func:`engaged`: the static forward it captures, its
eager forward); between calls the module runs, copies, pickles and saves as its own. :func:`align_gated_mlp`
re-points the module's own parameters at views of the padded storage (``param.data``: the same ``Parameter``
objects, no second copy of the weights), so values copied into them (``load_state_dict``, ``copy_``) reach the
padded forward, the module's own forward and ``state_dict`` keep working, and ``save_pretrained`` writes compact
tensors (transformers clones tensors that share storage before writing). ``restore()`` gives them compact storage
again. Moving or casting the tower rebinds the parameters: ``encgraph.graphed`` notices it
(:mod:`encgraph.models.module_state`) and builds its adapter, and so the padding, again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
import attrs
import torch
import torch.nn.functional as F

from encgraph._validate import describe
from encgraph.errors import InputTypeError

__all__ = [
    "ALIGN", "LayoutPatch", "align_gated_mlp", "apply_all", "describe_patches", "engaged", "linear_patch_embed",
    "restore_all",
]

ALIGN = 8
"""Elements of a 2-byte dtype per 16 bytes: the row alignment cuBLAS's Hopper matmul kernels need."""


@attrs.define(eq=False)
class LayoutPatch:
    """One applied rewrite: its instance ``forward`` is set on the submodule only while engaged (``engage()`` /
    ``disengage()``; :func:`engaged`), so that between an adapter's own forwards the module is its own;
    ``restore()`` disengages and runs ``undo`` (idempotent)."""

    module: torch.nn.Module
    what: str
    forward: Callable[..., torch.Tensor] | None = None
    undo: Callable[[], None] | None = None
    restored: bool = False

    def engage(self) -> None:
        if not self.restored and self.forward is not None:
            self.module.__dict__["forward"] = self.forward

    def disengage(self) -> None:
        if self.module.__dict__.get("forward") is self.forward:
            del self.module.__dict__["forward"]

    def restore(self) -> None:
        if self.restored:
            return
        self.disengage()
        if self.undo is not None:
            self.undo()
        self.restored = True


def linear_patch_embed(patch_embed: torch.nn.Module, *, proj: str = "proj") -> LayoutPatch | None:
    """Run ``patch_embed`` (input ``(rows, C*T*P*P)``, output ``(rows, hidden)``) as one ``F.linear`` when its
    ``proj`` is a 2-D or 3-D convolution whose stride equals its kernel, without padding, dilation or groups.

    Returns ``None`` (nothing changed) for any other ``proj`` (e.g. already an ``nn.Linear``). The weight is read
    at each call as a ``(hidden, C*T*P*P)`` view: no copy, and the module keeps working after ``.to()``.
    """
    conv = getattr(patch_embed, proj, None)
    if not isinstance(conv, (torch.nn.Conv2d, torch.nn.Conv3d)):
        return None
    padding = conv.padding
    unpadded = padding == "valid" if isinstance(padding, str) else not any(padding)
    dilated = any(d != 1 for d in conv.dilation)
    if tuple(conv.stride) != tuple(conv.kernel_size) or not unpadded or dilated or conv.groups != 1:
        return None
    width = conv.in_channels * math.prod(conv.kernel_size)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = conv.weight
        # (rows, C*T*P*P): the processor's rows are the flattened (C, T, P, P) patches the conv would see.
        return F.linear(hidden_states.reshape(-1, width).to(weight.dtype), weight.reshape(weight.shape[0], width),
                        conv.bias)

    return LayoutPatch(patch_embed, "patch embedding as one matmul", forward)


def align_gated_mlp(
    mlp: torch.nn.Module,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    act: str = "act_fn",
    multiple: int = ALIGN,
) -> LayoutPatch | None:
    """Pad a gated MLP (``down(act(gate(x)) * up(x))``) to an intermediate size that is a multiple of ``multiple``
    and fuse ``gate`` and ``up`` into one matmul. Returns ``None`` (nothing changed) when the size is aligned.

    Storage after the call (``I`` the intermediate size, ``P`` it rounded up, ``H`` the hidden size): one
    ``(2P, H)`` gate-up weight (gate rows ``[0, I)``, up rows ``[P, P + I)``, zeros elsewhere), a ``(2P,)`` bias
    if the projections have biases, and an ``(H, P)`` down weight (zero columns past ``I``); the module's
    parameters are views of them. Forward: ``(..., H)`` in, ``(..., H)`` out, in the weights' dtype.
    """
    layers = [getattr(mlp, name, None) for name in (gate, up, down)]
    if not all(isinstance(layer, torch.nn.Linear) for layer in layers):
        raise InputTypeError(
            f"align_gated_mlp: expected nn.Linear {gate}, {up} and {down} on {type(mlp).__name__}, got "
            f"{[describe(layer) for layer in layers]}."
        )
    g, u, d = layers
    assert isinstance(g, torch.nn.Linear) and isinstance(u, torch.nn.Linear) and isinstance(d, torch.nn.Linear)
    inner, hidden = g.out_features, g.in_features
    if (u.out_features, u.in_features, d.in_features, d.out_features) != (inner, hidden, inner, hidden) or (
        (g.bias is None) != (u.bias is None)
    ):
        raise InputTypeError(
            f"align_gated_mlp: {type(mlp).__name__} is not a gated MLP of one width: {gate} {tuple(g.weight.shape)}, "
            f"{up} {tuple(u.weight.shape)}, {down} {tuple(d.weight.shape)}, biases on {gate}/{up}: "
            f"{g.bias is not None}/{u.bias is not None}."
        )
    if inner % multiple == 0:
        return None
    act_fn = getattr(mlp, act)
    padded = -(-inner // multiple) * multiple
    with torch.no_grad():
        gate_up = g.weight.new_zeros(2 * padded, hidden)
        gate_up[:inner] = g.weight
        gate_up[padded : padded + inner] = u.weight
        gate_up_bias = None
        if g.bias is not None and u.bias is not None:
            gate_up_bias = g.bias.new_zeros(2 * padded)
            gate_up_bias[:inner] = g.bias
            gate_up_bias[padded : padded + inner] = u.bias
        down_weight = d.weight.new_zeros(hidden, padded)
        down_weight[:, :inner] = d.weight
        # The originals' storage is released here: the parameters now live in the padded tensors.
        g.weight.data = gate_up[:inner]
        u.weight.data = gate_up[padded : padded + inner]
        if gate_up_bias is not None:
            g.bias.data = gate_up_bias[:inner]  # type: ignore[union-attr]
            u.bias.data = gate_up_bias[padded : padded + inner]  # type: ignore[union-attr]
        d.weight.data = down_weight[:, :inner]
    down_bias = d.bias

    def forward(hidden_state: torch.Tensor) -> torch.Tensor:
        gate_out, up_out = F.linear(hidden_state, gate_up, gate_up_bias).split(padded, dim=-1)
        return F.linear(act_fn(gate_out) * up_out, down_weight, down_bias)

    def undo() -> None:
        with torch.no_grad():
            for param in (g.weight, u.weight, g.bias, u.bias, d.weight):
                if param is not None:
                    param.data = param.data.clone(memory_format=torch.contiguous_format)

    return LayoutPatch(mlp, f"gated MLP padded {inner} -> {padded}, gate and up fused", forward, undo)


def apply_all(rewrites: list[Callable[[], LayoutPatch | None]]) -> list[LayoutPatch]:
    """Apply ``rewrites`` in order and return the patches that changed something; if one raises, restore the
    ones already applied (the tower is left as it was) and re-raise."""
    done: list[LayoutPatch] = []
    try:
        for rewrite in rewrites:
            patch = rewrite()
            if patch is not None:
                done.append(patch)
    except BaseException:
        for patch in reversed(done):
            patch.restore()
        raise
    return done


@contextlib.contextmanager
def engaged(patches: list[LayoutPatch]) -> Iterator[None]:
    """The rewritten forwards in place inside the block (an adapter's own forwards), the module's own after it."""
    for patch in patches:
        patch.engage()
    try:
        yield
    finally:
        for patch in patches:
            patch.disengage()


def restore_all(patches: list[LayoutPatch]) -> None:
    """Restore ``patches`` in reverse order (idempotent)."""
    for patch in reversed(patches):
        patch.restore()


def describe_patches(patches: list[LayoutPatch]) -> list[str]:
    """One line per applied patch: the submodule's class and what changed (for reprs and logs)."""
    return [f"{type(p.module).__name__}: {p.what}" for p in patches]

