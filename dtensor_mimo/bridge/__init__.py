"""The bridge: cross-mesh redistribution of the tensor that flows between two modules.

`plan` is the pure planner (index arithmetic, no communication).
"""

from dtensor_mimo.bridge.plan import (
    Copy,
    MeshSpec,
    Plan,
    PlanError,
    RankPlan,
    Recv,
    Send,
    backward_specs,
    plan,
    plan_backward,
    plan_backward_for_rank,
    plan_for_rank,
)

__all__ = [
    "Copy",
    "MeshSpec",
    "Plan",
    "PlanError",
    "RankPlan",
    "Recv",
    "Send",
    "backward_specs",
    "plan",
    "plan_backward",
    "plan_backward_for_rank",
    "plan_for_rank",
]

from dtensor_mimo.bridge.hops import hop_rows  # noqa: E402
from dtensor_mimo.bridge.exchange import BufferPool  # noqa: E402
from dtensor_mimo.bridge.redistribute import (  # noqa: E402
    DEFAULT_BUFFERS,
    Bridge,
    Side,
    post_together,
    redistribute,
    redistribute_many,
)

__all__ += ["Bridge", "BufferPool", "DEFAULT_BUFFERS", "Side", "hop_rows", "post_together", "redistribute",
            "redistribute_many"]
