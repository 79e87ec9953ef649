"""The pure planner: budget ladders, item specs, packing into batches, and data-parallel balancing.

Decides *what* to replay (which items go together, through which captured budget, or eager) without touching
a GPU.  Needs only numpy, attrs and the standard library: importing it never imports torch.

    >>> from encgraph.packing import ItemSpec, budget_ladder, pack
    >>> ladder = budget_ladder(64, 1024)
    >>> plan = pack([ItemSpec(300), ItemSpec(200), ItemSpec(700)], ladder, max_items=8)
    >>> [(b.items, b.budgets["default"]) for b in plan.batches]
    [((1, 0), 512), ((2,), 1024)]
"""

from __future__ import annotations

from encgraph.packing.sharding import balance
from encgraph.packing.ladder import DEFAULT_PATH, budget_ladder, dense_ladder, normalize_ladder, normalize_ladders
from encgraph.packing.limits import Limits, default_limits
from encgraph.packing.greedy import pack
from encgraph.packing.plan import Batch, EagerReason, Plan
from encgraph.packing.spec import ItemSpec

__all__ = [
    "DEFAULT_PATH",
    "Batch",
    "EagerReason",
    "ItemSpec",
    "Limits",
    "Plan",
    "balance",
    "budget_ladder",
    "default_limits",
    "dense_ladder",
    "normalize_ladder",
    "normalize_ladders",
    "pack",
]

from encgraph.packing.costs import CostModel, EagerCost  # noqa: E402

__all__ += ["CostModel", "EagerCost"]
from encgraph.packing.tuning import DEFAULT_COSTS, TunedLadder, default_cost_model, tune_ladder  # noqa: E402

__all__ += ["DEFAULT_COSTS", "TunedLadder", "default_cost_model", "tune_ladder"]
