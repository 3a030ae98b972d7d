"""``python -m dtensor_mimo.plan``: the layout planner on a trainer config, the same command as
``python -m dtensor_mimo.train plan`` (`dtensor_mimo.train.plan`: it reads the trainer's config,
modules and data, so it belongs to the application, above this package). Started as that command
in this process's place (a process, not an import: the planner's package never depends on the
trainer's)."""

import os
import sys

os.execv(sys.executable, [sys.executable, "-m", "dtensor_mimo.train", "plan", *sys.argv[1:]])
