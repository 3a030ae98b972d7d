"""Fingerprints of state the ranks must share (`dtensor_mimo.layout.fingerprint`), in one process.

| input                                                          | expected                                |
|----------------------------------------------------------------|-----------------------------------------|
| equal values in another process (hash seed differs)            | the same fingerprint                    |
| a token id, an item count, a requires_grad flag changed         | another fingerprint                     |
| sums of (fp, fp²) over 2 to 2**20 ranks, all equal / one differs | agreed / not agreed (each sum exact)    |
| gathered (fp, summary), rank 2 differs                          | a message naming rank 2 and both states  |
| `summary` of options / configs                                  | only the fields that differ from default |
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dtensor_mimo.layout import MimoLayout, Parallelism
from dtensor_mimo.layout.fingerprint import (STEP_BITS, agreed, agreement_terms, batch_fingerprint, disagreement,
                                             fingerprint, step_bits, summary, trainable_fingerprint)

TOKENS = torch.arange(24).reshape(2, 12)
ITEMS = {"vision": ((1, 0), (16, 0)), "audio": ((2, 1), (16, 8))}


def test_equal_values_in_another_process_give_the_same_fingerprint() -> None:
    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)})
    here = (fingerprint(layout, {"b": 1, "a": {2, 1}}), batch_fingerprint(TOKENS, ITEMS))
    code = ("import torch; from dtensor_mimo.layout import MimoLayout, Parallelism; "
            "from dtensor_mimo.layout.fingerprint import fingerprint, batch_fingerprint; "
            "layout = MimoLayout({'vision': Parallelism(dp=2), 'language': Parallelism(tp=2)}); "
            "print(fingerprint(layout, {'a': {1, 2}, 'b': 1}), "
            "batch_fingerprint(torch.arange(24).reshape(2, 12), {'audio': ((2, 1), (16, 8)), 'vision': ((1, 0), (16, 0))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert tuple(map(int, out.stdout.split())) == here


def test_a_changed_detail_changes_the_fingerprint() -> None:
    base = batch_fingerprint(TOKENS, ITEMS)
    other_tokens = TOKENS.clone()
    other_tokens[1, 5] += 1
    assert batch_fingerprint(other_tokens, ITEMS) != base
    assert batch_fingerprint(TOKENS, {**ITEMS, "audio": ((1, 2), (8, 16))}) != base
    assert batch_fingerprint(TOKENS, {**ITEMS, "audio": ((2, 1), (16, 9))}) != base
    assert base < 2 ** STEP_BITS
    names = [("vision.encoder.w", True), ("language.w", True)]
    assert trainable_fingerprint(names) != trainable_fingerprint([("vision.encoder.w", False), ("language.w", True)])
    assert trainable_fingerprint(names) == trainable_fingerprint(names[::-1])


def _ring_sums(terms: list[tuple[float, float]]) -> tuple[float, float]:
    """The terms summed one by one, in float64, as a ring all-reduce adds them."""
    one = square = 0.0
    for a, b in terms:
        one, square = one + a, square + b
    return one, square


@pytest.mark.parametrize("world, bits", [(2, 20), (8192, 20), (8193, 19), (16384, 19), (32768, 19), (32769, 18),
                                         (1 << 20, 16)])
def test_sums_of_terms_tell_agreement_exactly(world, bits) -> None:
    """Summed in a ring's order, the terms of `world` equal fingerprints say agreed, and one
    rank's fingerprint one less says not (20-bit squares summed over 16,384 ranks or more round
    in float64: with `STEP_BITS` bits at every world size, those worlds fail here)."""
    assert step_bits(world) == bits
    for fp in (2 ** STEP_BITS - 1, 0b1010_1100_0111_0101_0011):
        low = fp & ((1 << bits) - 1)
        terms = [agreement_terms(fp, world)] * world
        assert agreed(fp, *_ring_sums(terms), world)
        terms[17 % world] = agreement_terms(low - 1, world)
        sums = _ring_sums(terms)
        assert not agreed(fp, *sums, world) and not agreed(low - 1, *sums, world)
    # Values that keep the plain sum: only the squares tell.
    pair = [agreement_terms(10, 2), agreement_terms(30, 2)]
    assert not agreed(20, *_ring_sums(pair), 2)


def test_disagreement_names_the_ranks() -> None:
    per_rank = [(7, "vision dp2"), (7, "vision dp2"), (9, "vision dp4"), (7, "vision dp2")]
    message = disagreement(per_rank, "layout")
    assert message is not None and "rank 0: vision dp2; rank 2: vision dp4" in message
    assert "rank 1" not in message and "rank 3" not in message
    assert disagreement([(7, "a")] * 3, "layout") is None


def test_disagreement_names_every_differing_rank_up_to_four() -> None:
    """Every rank that differs from rank 0 is named (up to four, then counted), not only the first."""
    per_rank = [(7, "dp2"), (9, "dp4"), (7, "dp2"), (8, "dp3")]
    message = disagreement(per_rank, "layout")
    assert message is not None and "rank 1: dp4; rank 3: dp3." in message and "rank 2" not in message
    many = disagreement([(7, "dp2")] + [(9, f"dp{r}") for r in range(1, 7)], "layout")
    assert many is not None and "rank 4: dp4 (+2 more ranks)" in many and "rank 5" not in many


def test_summary_shows_what_differs_from_the_defaults() -> None:
    from dtensor_mimo import ParallelOptions, PipelineConfig

    assert summary(ParallelOptions()) == "ParallelOptions()"
    assert summary({"vision": ParallelOptions(fsdp=False), "language": PipelineConfig(microbatches=4)}) == \
        "{vision: ParallelOptions(fsdp=False), language: PipelineConfig(microbatches=4)}"
    assert summary(list(range(1000)), limit=20) == "[0, 1, 2, 3, 4, 5..."
