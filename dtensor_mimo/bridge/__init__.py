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
]

from dtensor_mimo.bridge.redistribute import Bridge, redistribute, redistribute_many  # noqa: E402

__all__ += ["Bridge", "redistribute", "redistribute_many"]
