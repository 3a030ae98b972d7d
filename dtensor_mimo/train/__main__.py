"""``python -m dtensor_mimo.train``: see `dtensor_mimo.train.launch`."""

import sys

from dtensor_mimo.train.launch import main

sys.exit(main())
