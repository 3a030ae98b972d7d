"""``python -m dtensor_mimo.plan``: the command lives in `dtensor_mimo.train.plan`, because it reads
the trainer's config; this entry point only calls it (entry points are exempt from the layer rule,
`tests/test_layers.py`: nothing imports them)."""

import sys

from dtensor_mimo.train.plan import main

sys.exit(main())
