"""The layout planner: per-module costs, a cost model of a step, and the search for the best
per-module layout of a job on a given world.

Layer: above `mimo` (it describes what `MimoModel` runs) and below `train` (the trainer's
``--layout.auto`` asks it). The core (`profile`, `cost`, `search`, `report`, `paper`) is pure
Python over integers and seconds; `measure` times modules and links on this machine. The command
line, which reads the trainer's config, is `dtensor_mimo.train.plan` (``python -m
dtensor_mimo.plan`` runs it).
"""

from dtensor_mimo.plan.candidate import Candidate, overrides_of
from dtensor_mimo.plan.cost import ModuleCost, Prediction, module_cost, predict
from dtensor_mimo.plan.profile import Affine, DeviceProfile, Job, Link, ModuleProfile
from dtensor_mimo.plan.report import entry, table, write_json
from dtensor_mimo.plan.search import (InvalidCandidate, SearchResult, SearchSpace, canonical, enumerate_layouts,
                                      homogeneous, search, validate)

__all__ = [
    "Affine", "Candidate", "DeviceProfile", "InvalidCandidate", "Job", "Link", "ModuleCost", "ModuleProfile",
    "Prediction", "SearchResult", "SearchSpace", "canonical", "entry", "enumerate_layouts", "homogeneous",
    "module_cost", "overrides_of", "predict", "search", "table", "validate", "write_json",
]
