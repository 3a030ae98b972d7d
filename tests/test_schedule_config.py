"""Pure rules of a pipelined step: `PipelineConfig`, layers per stage, microbatch sizes, and the
layouts `MimoModel` refuses (before any process group is touched)."""

from __future__ import annotations

import pytest

from dtensor_mimo import LayoutError, MimoLayout, Parallelism, PipelineConfig
from dtensor_mimo.schedule.checks import check_model as _check_model
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
from dtensor_mimo.schedule import SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_microbatching, stage_layers
from dtensor_mimo.schedule.config import rank_stages, stage_rank
from tests.harness import needs_torch

REFUSED_BEFORE_2_13 = needs_torch((2, 13), "the zero-bubble schedules are refused by name before 2.13")

P = Parallelism


def test_even_split_gives_earlier_stages_the_remainder() -> None:
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]


def test_explicit_split() -> None:
    assert stage_layers(6, 2, (1, 5)) == [range(0, 1), range(1, 6)]


@pytest.mark.parametrize("split", [(3, 3), (6, 0), (2, 2, 2)])
def test_bad_split_names_what_would_work(split) -> None:
    with pytest.raises(LayoutError, match=r"2 stages \(pp x virtual_stages\) at least one layer each, 5 layers"):
        stage_layers(5, 2, split)


def test_more_stages_than_layers() -> None:
    with pytest.raises(LayoutError, match="'language' has 2 layers for 4 pipeline stages"):
        stage_layers(2, 4)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        PipelineConfig(microbatches=0)
    with pytest.raises(ValueError, match="schedule='ZBV' is not one of"):
        PipelineConfig(microbatches=2, schedule="ZBV")
    with pytest.raises(ValueError, match=r"schedule='DualPipeV' runs exactly two stages per rank \(a V: pp rank r "
                                         r"holds stages r and 2\*pp-1-r\) but virtual_stages=3; set virtual_stages=2"):
        PipelineConfig(microbatches=2, schedule="DualPipeV", virtual_stages=3)
    with pytest.raises(ValueError, match="'1F1B' runs one stage per rank but virtual_stages=2"):
        PipelineConfig(microbatches=2, virtual_stages=2)
    assert PipelineConfig(4, "Interleaved1F1B", 2).num_stages(pp=3) == 6


@pytest.mark.parametrize("split, shown", [(4, "4"), (2.5, "2.5"), ("31", "'31'"), ((True, 3), r"\(True, 3\)"),
                                          ((2, 2.0), r"\(2, 2.0\)")])
def test_split_of_no_layer_counts_is_refused_by_name(split, shown) -> None:
    """`PipelineConfig.split` is layers per stage: a single number (split=4) failed in `tuple()`
    with "'int' object is not iterable", naming neither the field nor the value; a string was cut
    into its characters (the error then showed ('3', '1')); a bool counted as one layer (while
    microbatches=True is refused by name)."""
    with pytest.raises(ValueError, match=rf"PipelineConfig.split={shown}: .*layers per stage.*integers >= 1"):
        PipelineConfig(microbatches=2, split=split)
    if isinstance(split, tuple):  # a split made by hand reaches `stage_layers` without the config
        with pytest.raises(LayoutError, match=r"PipelineConfig.split=\("):
            stage_layers(4, len(split), split)
    assert PipelineConfig(microbatches=2, split=[3, 1]).split == (3, 1)



def test_numpy_integers_are_counts() -> None:
    """A split computed with NumPy (``np.array_split``'s sizes, an ``np.array``) is layers per
    stage: it was refused as "give decoder layers per stage, integers >= 1" though it gave them;
    the counts are kept as Python ints."""
    import numpy as np

    config = PipelineConfig(microbatches=np.int64(4), virtual_stages=np.int32(2), schedule="Interleaved1F1B",
                            split=np.array([3, 1, 2, 2]))
    assert config.split == (3, 1, 2, 2) and all(type(n) is int for n in config.split)
    assert type(config.microbatches) is int and config.num_stages(pp=2) == 4
    assert [list(r) for r in stage_layers(8, 4, config.split)] == [[0, 1, 2], [3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"PipelineConfig.split=array\(\[3, 0\]\)"):
        PipelineConfig(split=np.array([3, 0]))


def test_batch_not_divisible_by_microbatches_times_dp() -> None:
    check_microbatching(8, 4, 2)
    with pytest.raises(ValueError, match=r"12 samples cannot be cut into 4 microbatches x 'language' "
                                         r"dp=2: .* multiple of 4x2=8 \(e.g. 8 or 16\); with 12 samples, "
                                         r"these microbatch counts work: 1, 2, 3, 6"):
        check_microbatching(12, 4, 2)


def _modules(n_layers: int = 2):
    vit = ViTConfig.tiny()
    llama = Llama(LlamaConfig.tiny(n_layers=n_layers))
    return llama, {"vision": ModalityEncoder(ViT(vit), Projection(vit.dim, llama.config.dim))}


def test_language_pp_needs_a_pipeline_config() -> None:
    llama, encoders = _modules()
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    with pytest.raises(LayoutError, match="'language' has pp=2: pass pipeline=PipelineConfig"):
        _check_model(layout, llama, encoders, "language", {}, None)
    _check_model(layout, llama, encoders, "language", {}, PipelineConfig(microbatches=2))


@pytest.mark.parametrize("offsets, frozen, sp, match", [
    ({"vision": 0, "language": 0}, False, False, "its ranks must be its own"),
    (None, True, False, "every encoder must train and sit on ranks of its own"),
    (None, False, True, "sequence parallel is not supported on encoder stages"),
])
def test_encoder_pipelines_that_cannot_run_are_refused_by_name(offsets, frozen, sp, match) -> None:
    from dtensor_mimo import ParallelOptions

    llama, encoders = _modules()
    if frozen:
        encoders["vision"].requires_grad_(False)
    layout = MimoLayout({"vision": P(pp=2), "language": P(pp=2)}, offsets=offsets)
    with pytest.raises(LayoutError, match=f"encoder 'vision' has pp=2: {match}"):
        _check_model(layout, llama, encoders, "language", {"vision": ParallelOptions(sp=sp)},
                     PipelineConfig(microbatches=2))


def test_encoder_pipeline_needs_a_pipeline_config_and_layers_per_stage() -> None:
    llama, encoders = _modules()  # a 2-layer ViT
    with pytest.raises(LayoutError, match="encoder 'vision' has pp=2: pass pipeline=PipelineConfig"):
        _check_model(MimoLayout({"vision": P(pp=2), "language": P()}), llama, encoders, "language", {}, None)
    with pytest.raises(LayoutError, match="'vision' has 2 layers for 4 pipeline stages"):
        _check_model(MimoLayout({"vision": P(pp=4), "language": P()}), llama, encoders, "language", {},
                     PipelineConfig(microbatches=2))


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
@REFUSED_BEFORE_2_13
def test_zero_bubble_refuses_compiled_stages(schedule) -> None:
    from dtensor_mimo import ParallelOptions

    llama, encoders = _modules(n_layers=4)
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    zb = PipelineConfig(microbatches=4, schedule=schedule, virtual_stages=2)
    with pytest.raises(LayoutError, match=rf"schedule '{schedule}' splits backward into an input pass and a weight "
                                          r"pass, but 'language' has compile=True: .* whole backward in both passes"):
        _check_model(layout, llama, encoders, "language", {"language": ParallelOptions(compile=True)}, zb)
    _check_model(layout, llama, encoders, "language", {"language": ParallelOptions()}, zb)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
@REFUSED_BEFORE_2_13
def test_zero_bubble_refuses_fsdp_resharding_after_forward(schedule) -> None:
    """FSDP2 resharding after each forward, under a split backward at dp·cp 2, gave wrong
    gradients against the single-process run (InterleavedZeroBubble) or a KeyError in torch's
    weight pass (the V schedules): refused by name. Kept gathered (tests/test_pipeline.py's
    zero_bubble_fsdp) or without FSDP2 (zero_bubble_summed) the gradients are right."""
    from dtensor_mimo import ParallelOptions

    llama, encoders = _modules(n_layers=4)
    zb = PipelineConfig(microbatches=4, schedule=schedule, virtual_stages=2)
    for language in (P(pp=2, dp=2), P(pp=2, cp=2)):
        layout = MimoLayout({"vision": P(), "language": language})
        with pytest.raises(LayoutError, match=rf"schedule '{schedule}' splits backward .* fails with FSDP2 resharding "
                                              r"'language'.s parameters after each forward over dp·cp = 2 .* "
                                              r"ParallelOptions\(reshard_after_forward=False\)"):
            _check_model(layout, llama, encoders, "language", {}, zb)
        for fine in (ParallelOptions(reshard_after_forward=False), ParallelOptions(fsdp=False)):
            _check_model(layout, llama, encoders, "language", {"language": fine}, zb)
    _check_model(MimoLayout({"vision": P(), "language": P(pp=2)}), llama, encoders, "language", {}, zb)


def test_hsdp_needs_fsdp() -> None:
    """dp_replicate > 1 groups the ranks FSDP2 shards over: without FSDP2 it is refused by name."""
    from dtensor_mimo import ParallelOptions

    llama, encoders = _modules(n_layers=4)
    layout = MimoLayout({"vision": P(dp=2, dp_replicate=2), "language": P()})
    with pytest.raises(LayoutError, match=r"'vision' has dp_replicate=2 \(HSDP.*ParallelOptions\(fsdp=False\)"):
        _check_model(layout, llama, encoders, "language", {"vision": ParallelOptions(fsdp=False)}, None)
    _check_model(layout, llama, encoders, "language", {}, None)


@pytest.mark.parametrize("schedule", ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_is_refused_by_name_before_torch_2_13(schedule, monkeypatch) -> None:
    from dtensor_mimo.layout import torch_compat

    llama, encoders = _modules(n_layers=4)
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    zb = PipelineConfig(microbatches=4, schedule=schedule, virtual_stages=2)
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 11))
    with pytest.raises(LayoutError, match=rf"schedule '{schedule}' needs torch >= 2.13 .* use "
                                          r"schedule='Interleaved1F1B' or '1F1B', or torch 2.13"):
        _check_model(layout, llama, encoders, "language", {}, zb)
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 13))
    _check_model(layout, llama, encoders, "language", {}, zb)


def test_two_stages_on_one_rank_are_refused_by_name_before_torch_2_13(monkeypatch) -> None:
    """torch 2.11's stage set-up sends to the next stage, on the same rank at pp = 1 with virtual
    stages, which gloo refuses on the language ranks alone (test_fuzz drew it); pp = 2 is not."""
    from dtensor_mimo.layout import torch_compat

    llama, encoders = _modules(n_layers=4)
    looped = PipelineConfig(microbatches=4, schedule="Interleaved1F1B", virtual_stages=2)
    one_rank, two_ranks = (MimoLayout({"vision": P(), "language": P(pp=pp)}) for pp in (1, 2))
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 11))
    with pytest.raises(LayoutError, match=r"'language' runs 2 pipeline stages on each of its ranks \(pp=1, "
                                          r"virtual_stages=2\), which needs torch >= 2.13 .* use virtual_stages=1, "
                                          r"pp > 1, or torch 2.13"):
        _check_model(one_rank, llama, encoders, "language", {}, looped)
    _check_model(two_ranks, llama, encoders, "language", {}, looped)
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 13))
    _check_model(one_rank, llama, encoders, "language", {}, looped)


def test_too_few_layers_for_the_stages_is_refused_before_any_process_group() -> None:
    llama, encoders = _modules()  # 2 layers
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    with pytest.raises(LayoutError, match="'language' has 2 layers for 4 pipeline stages"):
        _check_model(layout, llama, encoders, "language", {},
                     PipelineConfig(microbatches=4, schedule="Interleaved1F1B", virtual_stages=2))


def test_looped_schedules_need_whole_rounds_of_microbatches() -> None:
    llama, encoders = _modules()
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    with pytest.raises(LayoutError, match="rounds of pp=2, but microbatches=5: use a multiple of 2"):
        _check_model(layout, llama, encoders, "language", {}, PipelineConfig(microbatches=5, schedule="LoopedBFS"))


def test_1f1b_needs_as_many_microbatches_as_stages() -> None:
    llama, encoders = _modules()
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    with pytest.raises(LayoutError, match=r"'1F1B' needs at least as many microbatches as 'language' has "
                                          r"stages \(pp=2\), got microbatches=1: use >= 2, or schedule='GPipe'"):
        _check_model(layout, llama, encoders, "language", {}, PipelineConfig(microbatches=1))
    _check_model(layout, llama, encoders, "language", {}, PipelineConfig(microbatches=1, schedule="GPipe"))


def test_every_training_schedule_torch_offers_is_accepted() -> None:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        _ScheduleForwardOnly,
        get_schedule_class,
    )
    from torch.distributed.pipelining import schedules

    offered = {c for c in vars(schedules).values() if isinstance(c, type) and c.__name__.startswith("Schedule")
               and issubclass(c, (PipelineScheduleSingle, PipelineScheduleMulti)) and c is not _ScheduleForwardOnly}
    assert {get_schedule_class(name) for name in SCHEDULES} == offered


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_stage_placement_is_torchs(pp: int, placement: str) -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for n_stages in (pp, 2 * pp, 3 * pp):
        want = generate_stage_to_rank_mapping(pp, n_stages, style=placement)
        assert [stage_rank(s, n_stages, pp, placement) for s in range(n_stages)] == [want[s] for s in range(n_stages)]
        assert sorted(s for r in range(pp) for s in rank_stages(r, n_stages, pp, placement)) == list(range(n_stages))


def test_v_placement_puts_first_and_last_stage_on_pp_rank_0() -> None:
    config = PipelineConfig(microbatches=8, schedule="ZBVZeroBubble", virtual_stages=2)
    assert config.placement == "v"
    assert [config.rank_stages(r, pp=4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert config.stage_rank(0, pp=4) == config.stage_rank(7, pp=4) == 0
    looped = PipelineConfig(microbatches=8, schedule="Interleaved1F1B", virtual_stages=2)
    assert looped.placement == "loop" and looped.rank_stages(0, pp=4) == [0, 4] and looped.stage_rank(7, pp=4) == 3


@REFUSED_BEFORE_2_13
def test_dualpipev_needs_as_many_microbatches_as_stages() -> None:
    llama, encoders = _modules(n_layers=4)
    layout = MimoLayout({"vision": P(), "language": P(pp=2)})
    with pytest.raises(LayoutError, match=r"'DualPipeV' needs at least as many microbatches as 'language' has stages "
                                          r"\(pp=2 x 2 = 4\), got microbatches=2: use >= 4"):
        _check_model(layout, llama, encoders, "language", {},
                     PipelineConfig(microbatches=2, schedule="DualPipeV", virtual_stages=2))
    _check_model(layout, llama, encoders, "language", {},
                 PipelineConfig(microbatches=2, schedule="ZBVZeroBubble", virtual_stages=2))


# ------------------------------------------------------------ torch's private pipelining API, pinned
#
# `dtensor_mimo.schedule.runtime.run_schedule` runs torch's schedules on microbatches it built
# itself (slices of the global batch, dp-sharded; ragged item counts for encoders), which torch
# 2.13's public `step()` cannot take: it chunks one batch evenly. So it calls the private
# `_step_microbatches` after doing to each stage what `step()` does first. A torch upgrade that
# changes either fails here, naming what `run_schedule` has to follow.

STEP_MICROBATCHES_PARAMS = ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs"]

# What `step()` runs before `_step_microbatches`, and what `run_schedule` does about each line.
STEP_PREPARATION = {
    "PipelineScheduleSingle": {
        "self._stage.has_backward = self._has_backward": "mirrored: stage.has_backward = True",
        "self._stage.clear_runtime_states()": "mirrored: stage.clear_runtime_states()",
    },
    "PipelineScheduleMulti": {
        "for stage in self._stages:\n    stage.has_backward = self._has_backward": "mirrored",
        "for stage in self._stages:\n    stage.clear_runtime_states()": "mirrored",
    },
}
STEP_REPLACED = ("not torch.is_grad_enabled()",  # the grad-mode check: our steps always run with grad
                 "self._split_inputs(", "_split_tensor(target",  # the chunking: our callers build the lists
                 "torch.tensor_split(target")  # (torch 2.11's spelling of the target's chunking)


def _preparation(step) -> list[str]:
    """The statements of `step`'s body before its `_step_microbatches` call (docstring skipped)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(step))).body[0].body
    out = []
    for statement in body:
        text = ast.unparse(statement)
        if "_step_microbatches(" in text:
            return out
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
            out.append(text)
    raise AssertionError(f"{step.__qualname__} no longer calls _step_microbatches: see "
                         "dtensor_mimo/schedule/runtime.py::run_schedule")


def test_private_torch_pipelining_api_we_rely_on() -> None:
    import inspect

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        get_schedule_class,
    )

    problems = []
    for name in SCHEDULES:
        cls = get_schedule_class(name)
        if not issubclass(cls, (PipelineScheduleSingle, PipelineScheduleMulti)):
            problems.append(f"{name!r}: {cls.__name__} is neither PipelineScheduleSingle nor PipelineScheduleMulti")
        method = getattr(cls, "_step_microbatches", None)
        if method is None:
            problems.append(f"{name!r}: {cls.__name__}._step_microbatches is gone")
            continue
        params = list(inspect.signature(method).parameters)
        if params[: len(STEP_MICROBATCHES_PARAMS)] != STEP_MICROBATCHES_PARAMS:
            problems.append(f"{name!r}: {cls.__name__}._step_microbatches{inspect.signature(method)} no longer "
                            f"starts with {STEP_MICROBATCHES_PARAMS}")
    for base in (PipelineScheduleSingle, PipelineScheduleMulti):
        expected = STEP_PREPARATION[base.__name__]
        done = _preparation(base.step)
        for text in done:
            if text not in expected and not any(marker in text for marker in STEP_REPLACED):
                problems.append(f"{base.__name__}.step() now also runs, before _step_microbatches:\n{text}")
        for text in expected:
            if text not in done:
                problems.append(f"{base.__name__}.step() no longer runs:\n{text}")
    if not callable(getattr(PipelineStage, "clear_runtime_states", None)):
        problems.append("PipelineStage.clear_runtime_states is gone")
    assert not problems, ("torch's pipelining changed under dtensor_mimo/schedule/runtime.py::run_schedule "
                          "(which calls the private _step_microbatches); update it:\n" + "\n".join(problems))


def test_crossing_order_interleaves_backward_j_with_forward_j_plus_window():
    from dtensor_mimo.schedule import crossing_order

    assert list(crossing_order(5, 2)) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                          ("F", 4), ("B", 3), ("B", 4)]
    assert list(crossing_order(3, 3)) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert list(crossing_order(2, 5)) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("schedule, virtual, pp, expected", [
    ("1F1B", 1, 1, 1),  # one stage: forward, backward, forward, ...
    ("1F1B", 1, 2, 2),  # stage 0 of 1F1B warms up with one forward per stage
    ("1F1B", 1, 4, 4),
    ("GPipe", 1, 2, 8),  # every forward first
    ("LoopedBFS", 2, 2, 8),  # every forward first; backwards last microbatch first
    ("Interleaved1F1B", 2, 2, 4),  # F0 F1 F2 F3 B0 B1 F4 F5 B2 B3 ... on stage 0 (torch's order)
    ("DualPipeV", 2, 2, 8),  # overlapped forward-backward actions: not modelled, every microbatch
])
def test_first_stage_in_flight_bound_of_each_schedule(schedule, virtual, pp, expected):
    """How many microbatches stage 0 runs forward before their gradients leave (8 microbatches):
    plus one, the crossing window lean encoders follow (`dtensor_mimo.schedule.order`)."""
    from dtensor_mimo.schedule import crossing_window
    from dtensor_mimo.schedule.order import in_flight

    config = PipelineConfig(microbatches=8, schedule=schedule, virtual_stages=virtual)
    assert in_flight(config, pp) == expected
    assert crossing_window(config, pp, lean=True) == min(8, expected + 1)  # one microbatch of slack
    assert crossing_window(config, pp, lean=False) == 8  # colocated / encoder pipelines: all forwards first


def test_first_stage_actions_follow_torch_zero_bubble_order():
    """Zero bubble at pp 2, 2 virtual stages, 4 microbatches: stage 0's split backward (I, W) as
    torch orders it; a gradient leaves after the microbatch's last backward pass."""
    from dtensor_mimo.schedule.order import first_stage_actions, in_flight

    config = PipelineConfig(microbatches=4, schedule="InterleavedZeroBubble", virtual_stages=2)
    actions = first_stage_actions(config, 2)
    assert [a for a in actions if a[0] == "F"] == [("F", k) for k in range(4)]
    assert sorted(j for kind, j in actions if kind == "W") == [0, 1, 2, 3]
    assert in_flight(config, 2) == 4


def test_the_shape_cache_keeps_the_most_recently_used() -> None:
    """`runtime.cached` (stages and schedules per shape): a new shape is built once and returned,
    and beyond `CACHED_SHAPES` the least recently used is dropped, never the one just built (a
    run's fifth sequence length or item bucket raised KeyError on every rank)."""
    from collections import OrderedDict

    from dtensor_mimo.schedule.runtime import CACHED_SHAPES, cached

    cache, built = OrderedDict(), []

    def get(key: int) -> str:
        return cached(cache, key, lambda: built.append(key) or f"stages {key}")

    for key in range(CACHED_SHAPES):
        assert get(key) == f"stages {key}"
    assert get(0) == "stages 0" and built == list(range(CACHED_SHAPES))  # a hit: not built again
    assert get(CACHED_SHAPES) == f"stages {CACHED_SHAPES}"  # drops 1, the least recently used
    assert list(cache) == [*range(2, CACHED_SHAPES), 0, CACHED_SHAPES]
    assert get(1) == "stages 1" and built == [*range(CACHED_SHAPES + 1), 1]
