"""``config.json`` of a Hugging Face model directory: what each model config's ``from_hf`` reads."""

from __future__ import annotations

import json
import os
from typing import Any


def read_config(path: str) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{path}: no config.json; point at a Hugging Face model directory")
    with open(file) as f:
        return json.load(f)
