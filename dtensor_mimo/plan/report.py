"""The planner's output: a ranked table for people, JSON entries for the trainer."""

from __future__ import annotations

import json
from typing import Any, Sequence

from dtensor_mimo.plan.cost import Prediction


def entry(pred: Prediction) -> dict[str, Any]:
    """One ``--json`` entry: the layout (trainer keys), microbatches, predicted step and peak."""
    return {**pred.candidate.as_json(), "predicted_step_s": pred.step_s, "predicted_peak_gib": pred.peak_gib}


def write_json(path: str, preds: Sequence[Prediction]) -> None:
    """The ranked list, fastest first (`entry` each)."""
    with open(path, "w") as f:
        json.dump([entry(p) for p in preds], f, indent=1)


def table(preds: Sequence[Prediction], names: Sequence[str], top: int | None = None,
          baseline: Prediction | None = None) -> str:
    """Rank, layout, M, predicted step, tokens/s, peak memory per rank and each module's idle
    fraction; `baseline` (e.g. the homogeneous layout) as a last row."""
    rows = [("#", "layout (module sizes @first rank)", "M", "step ms", "tokens/s", "peak GiB",
             *(f"idle {n}" for n in names))]
    shown = list(preds[:top] if top else preds)
    for i, p in enumerate(shown, 1):
        rows.append(_row(str(i) if p.fits else f"{i}!", p, names))
    if baseline is not None:
        rows.append(_row("base", baseline, names))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (0, 2, 3, 4, 5) or i > 5 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _row(rank: str, p: Prediction, names: Sequence[str]) -> tuple[str, ...]:
    return (rank, p.candidate.describe(), str(p.candidate.microbatches), f"{p.step_s * 1e3:.1f}",
            f"{p.tokens_per_s:,.0f}", f"{p.peak_gib:.2f}", *(f"{p.idle[n]:.2f}" for n in names))
