"""The any-module adapter: one call shape of a batch-first module, learned from the module's own answers.

``encgraph.graphed(module)`` gives every module no model adapter knows (timm, open_clip, torchvision, Hugging Face
backbones such as ViT or DINOv2, a user's own) this path. Each distinct call shape (:mod:`encgraph.models.call_spec`:
the structure of the arguments, every tensor's trailing shape, dtype and device, every other argument's value) is
one *shape family*; the hook (:mod:`encgraph.models.graphed_forward`) answers the first call of a family with the
module's own forward and learns the output's structure from that answer (:class:`OutputSpec`); a family seen
again gets a :class:`GenericModuleAdapter` and a runner of its own: a ladder of batch sizes, padding rows that
repeat the last item.

Batch-first means rows never mix across dim 0. No adapter can know that of an arbitrary module, so a family
splits or pads a batch only once the runner's self-check (``verify=True``, the default, at capture) has compared
padded batches of each budget with the module's forward on exactly their items; a module that fails it at any
budget (a disagreement, or an output of another row count: a module that packs its items into one sequence) answers
every call of that family with its own forward (:meth:`selfcheck_failed`), as do calls under ``RunMode.EAGER``
(nothing was verified there).

Outputs: any nesting of tuples, lists, dicts and registered containers (transformers' ``ModelOutput``, named
tuples) whose leaves are batch-first tensors or ``None``, rebuilt as the module's own type with
``torch.utils._pytree``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from encgraph._validate import check_int, describe
from encgraph.capture.compiling import Sizes
from encgraph.capture.grad import persistent
from encgraph.capture.protocol import AdapterConfig, BudgetUnit, BufferSpec, FillRule, PathSpec, StockCall
from encgraph.errors import InputError, InputTypeError
from encgraph.models._hf import repeated_blocks
from encgraph.models.batch_ladder import ONE_ITEM, concat_parts, take_rows
from encgraph.models.call_spec import CallSplit, describe_key, rebuild, split_call
from encgraph.models.own_forward import own_forward
from encgraph.packing import ItemSpec

__all__ = ["GenericModuleAdapter", "OutputSpec"]

PATH = "default"
SEEDS = 8
"""Items of a call shape's example kept to draw scratch inputs from."""


@attrs.frozen(eq=False)
class OutputSpec:
    """The structure of a module's output: the pytree spec, and per leaf either a tensor name (``out<i>``) or the
    constant it holds (``None``)."""

    spec: Any
    names: tuple[str | None, ...]

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n is not None)

    @classmethod
    def learn(cls, out: Any, batch: int) -> OutputSpec | str:
        """The spec of ``out`` (the module's answer to a call of ``batch`` items), or why its outputs cannot be
        split per item: a leaf that is neither ``None`` nor a tensor with ``batch`` rows in dim 0."""
        leaves, spec = pytree.tree_flatten(out)
        names: list[str | None] = []
        for leaf in leaves:
            if leaf is None:
                names.append(None)
            elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
                names.append(f"out{len(names)}")
            elif isinstance(leaf, torch.Tensor):
                return f"an output tensor of shape {tuple(leaf.shape)} is not batch-first ({batch} items)"
            else:
                return f"an output leaf of type {type(leaf).__name__} (not a tensor)"
        if not any(n is not None for n in names):
            return "no tensor in the output"
        return cls(spec, tuple(names))

    def named(self, out: Any) -> dict[str, torch.Tensor]:
        """The tensors of ``out`` (an output of the same structure) by name."""
        leaves, spec = pytree.tree_flatten(out)
        if spec != self.spec:
            raise InputError(
                f"module output: expected the structure of the module's earlier answers ({self.spec}), got {spec}; "
                "a module whose output structure depends on the batch size is not batch-first."
            )
        return {n: leaf for n, leaf in zip(self.names, leaves) if n is not None}

    def build(self, named: Mapping[str, torch.Tensor]) -> Any:
        return pytree.tree_unflatten([None if n is None else named[n] for n in self.names], self.spec)


class GenericModuleAdapter:
    """Adapter for one call shape of a batch-first module (items: rows of dim 0 of every tensor argument).

    Args:
        module: the module; its tensors' device is where buffers live.
        example: a call of the family (a :class:`~encgraph.models.call_spec.CallSplit`, e.g. the call that made
            the family recur); its first item, kept, seeds ``sample_inputs``.
        output: the structure of the module's answers to that call shape.
        max_batch: the largest batch size captured (default 32); the default ladder runs up to it.

    Buffers per budget ``B``: ``arg<i>`` ``(B, *trailing_i)`` in tensor ``i``'s dtype, REPEAT_LAST (padding rows
    repeat the sub-batch's last item). Outputs: ``out<i>`` ``(B, ...)``, the output's tensor leaves in order.
    """

    compile_dynamic: Sizes = Sizes.BATCH
    """How ``compile="auto"`` traces the repeated blocks (:func:`encgraph.capture.compiling.dynamic_sizes`): a call
    shape fixes every size but the batch, so the batch alone is symbolic, from the first trace, batch 1 included:
    one frame for every budget. torch's automatic dynamic (the largest budget static, then the batch symbolic,
    then batch 1) warmed up faster than every size symbolic on an H100
    (``benches/results/generic_compile_nvidia-h100-80gb-hbm3.md``: timm ViT-B 4.6 s against 5.3, ConvNeXt-B 19.0
    against 26.5) and ran as fast or faster (timm ViT-B at batch 32: 3.75 ms against 4.06); the batch alone symbolic
    keeps its kernels and traces once. :attr:`~encgraph.capture.compiling.Sizes.TOP_STATIC` (the top budget static
    in a second frame) is selectable here, not yet measured on a GPU (``benches/generic_compile.py``)."""

    def __init__(self, module: torch.nn.Module, example: CallSplit, output: OutputSpec, *, max_batch: int = 32) -> None:
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
        if not isinstance(example, CallSplit) or example.batch < 1:
            raise InputError(f"example: expected a CallSplit of at least one item, got {describe(example)}.")
        self._module = module
        self.key = example.key
        self.output = output
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        param = next(module.parameters(), None)
        self._device = param.device if param is not None else example.tensors[0].device
        self._dtype = param.dtype if param is not None else example.tensors[0].dtype
        self._shapes = [(tuple(t.shape[1:]), t.dtype) for t in example.tensors]
        # Up to SEEDS items of the example, kept: scratch items are drawn from them in turn, so that a sample batch
        # mixes items as calls do (a padded crop beside a full one), and the split check has several to compare.
        with persistent():
            self._seed = tuple(t[:SEEDS].detach().clone() for t in example.tensors)
        self._scales = [float(t.float().std()) if t.is_floating_point() and t.numel() > 1 else 1.0 for t in self._seed]
        self._not_batch_first: str | None = None
        self._split_verdict: tuple[str | None] | None = None  # the split check's, run before the capture
        self._config = AdapterConfig(  # read on every call: built once (the output's structure is known already)
            paths=PathSpec(PATH, 1, self.max_batch, outputs=self.output.tensor_names, unit=BudgetUnit.ITEMS),
            dtype=self._dtype,
            device=self._device,
        )

    @classmethod
    def of_call(cls, module: torch.nn.Module, *args: Any, max_batch: int = 32, **kwargs: Any) -> GenericModuleAdapter:
        """The adapter of the call shape of ``module(*args, **kwargs)``, for a runner built by hand (``graphed()``
        learns shapes from the calls themselves). Runs the module's own forward once on this example, under
        ``no_grad`` with its buffers restored after, to learn the output's structure."""
        from encgraph.models.module_state import buffers_restored

        split = split_call(args, kwargs)
        if isinstance(split, str):
            raise InputError(f"example call: expected batch-first tensor arguments, got {split}.")
        with torch.no_grad(), buffers_restored(module):
            output = OutputSpec.learn(own_forward(module)(*args, **kwargs), split.batch)
        if isinstance(output, str):
            raise InputError(f"example call: the module's output cannot be split per item: {output}.")
        return cls(module, split, output, max_batch=max_batch)

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> AdapterConfig:
        return self._config

    def describe(self) -> str:
        return describe_key(self.key)

    # -- the self-check's verdict
    @property
    def stock_reason(self) -> str | None:
        """Why every call of this shape is answered by the module's own forward (the self-check), or None."""
        return self._not_batch_first

    def selfcheck_failed(self, path: str, budget: int, reason: str) -> bool:
        """A padded batch disagreed with the module's forward on its items: rows mix across dim 0 (or padding
        changes the answer), so no split or padded batch may stand in for the module; every budget goes."""
        self._not_batch_first = "not batch-first (self-check: a padded batch differs from the module's forward)"
        return True

    # -- inputs
    def inputs_from_call(self, *args: Any, **kwargs: Any) -> CallSplit | StockCall:
        split = split_call(args, kwargs)
        if isinstance(split, str):
            return StockCall(split)
        if split.key != self.key:
            return StockCall("another call shape")
        return split

    def item_specs(self, inputs: CallSplit) -> list[ItemSpec]:
        if not isinstance(inputs, CallSplit) or inputs.key != self.key:
            raise InputTypeError(f"inputs: expected a CallSplit of shape {self.describe()}, got {describe(inputs)}.")
        return [ONE_ITEM] * inputs.batch

    def select(self, inputs: CallSplit, indices: Sequence[int]) -> CallSplit:
        return CallSplit(inputs.key, tuple(take_rows(t, indices) for t in inputs.tensors), len(indices))

    def concat(self, parts: Sequence[CallSplit]) -> CallSplit:
        """One call holding every part's items in order (each tensor argument concatenated in dim 0)."""
        parts = concat_parts(parts, CallSplit)
        if len(parts) == 1:
            return parts[0]
        tensors = tuple(torch.cat(column) for column in zip(*(p.tensors for p in parts)))
        return CallSplit(parts[0].key, tensors, sum(p.batch for p in parts))

    def sample_inputs(self, path: str, tokens: int) -> CallSplit:
        """``tokens`` scratch items drawn in turn from the kept items: floating tensors with noise of their scale
        added (the items differ), other dtypes (masks, ids, shapes) as they were. Never a caller's tensors."""
        n = check_int("tokens", tokens, minimum=1)
        rows = torch.arange(n, device=self._seed[0].device) % self._seed[0].shape[0]
        tensors = []
        for t, scale in zip(self._seed, self._scales):
            drawn = t.index_select(0, rows.to(t.device))
            if drawn.is_floating_point():
                drawn = drawn + torch.randn_like(drawn) * (scale if scale > 0 else 1.0)
            tensors.append(drawn)
        return CallSplit(self.key, tuple(tensors), n)

    def check_before_capture(self, tolerance: float) -> None:
        """The runner's hook before it captures its first graph (:class:`~encgraph.capture.selfcheck.SelfCheck`):
        the split check's eager forwards run now, while the graphs' pool holds nothing, so that their activations
        never sit beside it; :meth:`split_check` gives the verdict after the capture, as before."""
        self._split_verdict = (self._compare_split(tolerance),)

    def split_check(self, tolerance: float) -> str | None:
        """Whether each item's answer depends on its batch mates, which the padded self-check cannot see (it pads
        the same items): the module's forward on the kept items together against on each alone (scratch items,
        ``no_grad``; run before the capture by :meth:`check_before_capture`, else now). Returns why the shape may
        not be split (then every call of it is the module's own: :attr:`stock_reason`), or ``None``."""
        verdict = self._split_verdict[0] if self._split_verdict is not None else self._compare_split(tolerance)
        if verdict is not None:
            self._not_batch_first = verdict
        return verdict

    def _compare_split(self, tolerance: float) -> str | None:
        from encgraph.capture.agreement import relative_error

        sample = self.sample_inputs(PATH, self._seed[0].shape[0])
        if sample.batch < 2:
            return None
        with torch.no_grad():
            together = self.forward_eager(PATH, sample)
            alone = [self.forward_eager(PATH, self.select(sample, [i])) for i in range(sample.batch)]
        for name, value in together.items():
            worst = relative_error(torch.cat([a[name] for a in alone]), value)
            if not worst <= tolerance:
                return (f"not batch-first (an item's output depends on its batch mates: {worst:.3g} norm-relative on "
                        f"output {name!r})")
        return None

    # -- static buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        # Padding rows repeat the last item rather than zeros: a zero row is rarely a valid item (a crop whose mask
        # is all zeros, an image of 0x0 patches) and can switch what a module does for the whole batch (an
        # attention mask present or not), where a copy of a real item reads as the real items do.
        return {
            f"arg{i}": BufferSpec((budget, *shape), dtype, FillRule.REPEAT_LAST)
            for i, (shape, dtype) in enumerate(self._shapes)
        }

    def replay_values(self, path: str, inputs: CallSplit, budget: int) -> dict[str, torch.Tensor]:
        return {f"arg{i}": t for i, t in enumerate(inputs.tensors)}

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        return self._run([buffers[f"arg{i}"] for i in range(len(self._shapes))])

    def forward_eager(self, path: str, inputs: CallSplit) -> dict[str, torch.Tensor]:
        return self._run(inputs.tensors)

    def _run(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        args, kwargs = rebuild(self.key, tensors)
        return self.output.named(own_forward(self._module)(*args, **kwargs))

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return dict(parts[PATH])

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: CallSplit) -> Any:
        """The module's own output type, each tensor leaf concatenated over the call's items in input order."""
        return self.output_for_rows({n: torch.cat([r[n] for r in results]) for n in self.output.tensor_names}, inputs)

    def output_for_rows(self, rows: Mapping[str, torch.Tensor], inputs: CallSplit) -> Any:
        """The module's own output type from each output over the call's items (``runner.call_rows``)."""
        return self.output.build(rows)

    def compile_regions(self) -> list[torch.nn.Module]:
        """The module's repeated blocks (its longest list of same-class layers), compiled once for all of them and
        every batch size by ``compile="auto"``; none found: the runner compiles the whole static forward. Not their
        stack as one region (``benches/generic_compile.py``'s ``stack`` variants): on an H100 it raised every peak
        above reduce-overhead's and ConvNeXt-B's warm-up past it
        (``benches/results/anymodule_nvidia-h100-80gb-hbm3_stack-batch.md``)."""
        return repeated_blocks(self._module)

    def unwrap(self) -> torch.nn.Module:
        return self._module

    def __repr__(self) -> str:
        return f"GenericModuleAdapter({type(self._module).__name__}, {self.describe()}, max_batch={self.max_batch})"
