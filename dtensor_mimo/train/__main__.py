"""``python -m dtensor_mimo.train``: trains (`dtensor_mimo.train.launch`);
``python -m dtensor_mimo.train plan ...``: the layout planner on the same config
(`dtensor_mimo.train.plan`, also ``python -m dtensor_mimo.plan``)."""

import sys

if sys.argv[1:2] == ["plan"]:
    from dtensor_mimo.train.plan import main as plan

    sys.exit(plan(sys.argv[2:]))

from dtensor_mimo.train.launch import command

command()
