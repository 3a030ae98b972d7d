"""Per-module AdamW, no-decay groups, the lr schedule and the global clip, against plain torch.

The reference is `torch.optim.AdamW` per module with its two parameter groups written out by
hand (no weight decay on norms, biases and embedding tables, picked by name from the model
files), learning rates set before each update from the closed-form schedule below, and
`torch.nn.utils.clip_grad_norm_` over every parameter of every module.

    config    lr     betas        weight_decay  no_decay
    base      1e-2   (0.9, 0.95)  0.1           default   (language)
    vision    3e-3   (0.8, 0.9)   0.3           default
    audio     2e-2   (0.9, 0.95)  0.1           None: every parameter decays

    schedule  warmup 2 updates from 0.1 of the peak, cosine to 0.1 of the peak at update 4
    update    1     2     3     4     5
    factor    0.55  1.0   0.55  0.1   0.1

| test                                  | ranks | layout                                                  |
|---------------------------------------|-------|---------------------------------------------------------|
| test_schedule_shapes                  | 1     | -                                                       |
| test_no_decay_groups                  | 1     | -                                                       |
| test_matches_plain_adamw              | 1     | every module on one process; a skipped step in between  |
| test_state_dict_resumes               | 1     | -                                                       |
| test_state_dict_resumes_with_this_runs_config | 1 | another weight decay, betas and eps after the resume |
| test_state_dict_resumes_under_another_no_decay | 1 | other no-decay groups after the resume              |
| test_config_errors                    | 1     | -                                                       |
| test_config_errors_name_a_value_that_is_not_a_number | 1 | -                                            |
| test_distributed_matches_reference    | 4     | vision dp2 FSDP (0-1), audio dp2 all-reduce (0-1), language dp2 FSDP (2-3) |
|                                       | 4     | vision tp2·dp2 + sp (0-3), language tp4 (0-3), colocated |
| test_norm_before_reduce_gradients_is_refused_on_every_rank | 3 | vision (0), language tp2 + sp (1-2) |
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtensor_mimo import (AdamWConfig, LRSchedule, MimoModel, MimoOptimizer, ParallelOptions, Parallelism,
                          train_step)
from dtensor_mimo.assemble import assemble, embed_text
from dtensor_mimo.data import IGNORE_INDEX
from tests.harness import run_on_ranks
from tests.test_mimo import OPT, TOL, Case, _batches, _modules, _record, _reference

BASE = AdamWConfig(lr=1e-2, eps=1e-3, weight_decay=0.1, max_grad_norm=0.5)
PER_MODULE = {"vision": dataclasses.replace(BASE, lr=3e-3, betas=(0.8, 0.9), weight_decay=0.3),
              "audio": dataclasses.replace(BASE, lr=2e-2, no_decay=None)}
SCHEDULE = LRSchedule(warmup_steps=2, warmup_start=0.1, decay="cosine", total_steps=4, min_lr_ratio=0.1)
FACTORS = (0.55, 1.0, 0.55, 0.1, 0.1)  # 0.1 + 0.9 * n / 2 for n <= 2, then 0.1 + 0.9 * (1 + cos(pi p)) / 2
ENCODERS = ("vision", "audio")
# The parameters without weight decay, by name, from the model files: every bias, every norm's
# weight, the token, position and patch embeddings.
EMBEDDINGS = ("tok_embeddings.weight", "encoder.pos_embed", "encoder.patch_embed.weight")


def _no_decay_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters() if n.endswith(".bias") or "norm" in n or n in EMBEDDINGS}


class _OneProcess:
    """What `MimoOptimizer` reads of a `MimoModel`: every module here, unsharded."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules, self.module_names = modules, list(modules)
        self.device = torch.device("cpu")

    def module_parameters(self, name: str) -> dict[str, nn.Parameter]:
        return dict(self.modules[name].named_parameters())

    def refresh_fp8_scales(self) -> None:
        """No fp8 modules here."""


def _all_modules() -> dict[str, nn.Module]:
    llama, encoders = _modules(ENCODERS)
    return {**encoders, "language": llama}


class _Reference:
    """Plain AdamW per module with hand-built groups, lr set per update, torch's clip."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules, self.peaks, self.optimizers = modules, {}, {}
        for name, module in modules.items():
            config = PER_MODULE.get(name, BASE)
            exempt = set() if config.no_decay is None else _no_decay_names(module)
            named = dict(module.named_parameters())
            decay = [p for n, p in named.items() if n not in exempt]
            groups = [{"params": decay, "weight_decay": config.weight_decay},
                      {"params": [p for n, p in named.items() if n in exempt], "weight_decay": 0.0}]
            self.optimizers[name] = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas,
                                                      eps=config.eps)
            self.peaks[name] = config.lr

    def step(self, update: int) -> float:
        """Clip and apply update number `update` (0-based); returns the unclipped global norm."""
        params = [p for m in self.modules.values() for p in m.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(params, BASE.max_grad_norm).item()
        for name, opt in self.optimizers.items():
            for group in opt.param_groups:
                group["lr"] = self.peaks[name] * FACTORS[update]
            opt.step()
            opt.zero_grad()
        return norm


def _set_grads(modules: dict[str, nn.Module], seed: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in modules.values():
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * scale


# ------------------------------------------------------------------ one process


def test_schedule_shapes() -> None:
    def factors(schedule: LRSchedule, n: int) -> list[float]:
        return [schedule.factor(step) for step in range(n)]

    assert factors(LRSchedule(), 3) == [1.0, 1.0, 1.0]
    assert factors(LRSchedule(warmup_steps=4), 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert factors(SCHEDULE, 6) == pytest.approx([*FACTORS, 0.1])
    assert factors(LRSchedule(warmup_steps=1, decay="linear", total_steps=5, min_lr_ratio=0.2), 6) == \
        pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert factors(LRSchedule(decay="cosine", total_steps=4), 5) == \
        pytest.approx([(1 + math.cos(math.pi * n / 4)) / 2 for n in (1, 2, 3, 4, 4)])


def test_no_decay_groups() -> None:
    modules = _all_modules()
    optimizer = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE)
    groups = {}
    for name, module in modules.items():
        names = {id(p): n for n, p in module.named_parameters()}
        groups[name] = {g["weight_decay"]: {names[id(p)] for p in g["params"]}
                        for g in optimizer.optimizers[name].param_groups}
    everything = {n: {p for p, _ in m.named_parameters()} for n, m in modules.items()}
    exempt = {n: _no_decay_names(m) for n, m in modules.items()}
    assert groups == {
        "vision": {0.3: everything["vision"] - exempt["vision"], 0.0: exempt["vision"]},
        "audio": {0.1: everything["audio"]},  # no_decay=None
        "language": {0.1: everything["language"] - exempt["language"], 0.0: exempt["language"]},
    }
    assert {"tok_embeddings.weight", "layers.1.ffn_norm.weight", "norm.weight"} <= exempt["language"]


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_matches_plain_adamw(implementation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both forms of AdamW: fused (CPU and CUDA) and foreach (devices without a fused kernel)."""
    from dtensor_mimo.optim import optimizer as module

    monkeypatch.setattr(module, "_implementation", lambda device: {implementation: True})
    modules, reference = _all_modules(), _Reference(_all_modules())
    optimizer = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE, schedule=SCHEDULE)
    assert all(opt.defaults.get(implementation) for opt in optimizer.optimizers.values())
    update, clipped = 0, 0
    for seed, scale in enumerate((1e-3, 8e-3, float("nan"), 2e-3, 8e-3)):
        assert optimizer.lrs() == pytest.approx({n: reference.peaks[n] * FACTORS[update] for n in modules})
        _set_grads(modules, seed, scale)
        if math.isnan(scale):  # a non-finite norm: no weight moves, the schedule waits
            before = copy.deepcopy(modules)
            assert optimizer.step(float("nan")) is False
            for name in modules:
                for (n, p), q in zip(modules[name].named_parameters(), before[name].parameters()):
                    assert torch.equal(p, q) and p.grad is None, f"{name}.{n} changed in a skipped step"
            continue
        _set_grads(reference.modules, seed, scale)
        norm = reference.step(update)
        clipped += norm > BASE.max_grad_norm
        assert optimizer.step(norm) is True
        update += 1
        for name in modules:
            for (n, p), q in zip(modules[name].named_parameters(), reference.modules[name].parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"update {update} {name}.{n}: {m}")
    assert 0 < clipped < update, "clipping should engage on some updates and not on others"


def test_state_dict_resumes() -> None:
    modules = _all_modules()
    optimizer = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE, schedule=SCHEDULE)
    for seed in range(2):
        _set_grads(modules, seed, 1e-3)
        optimizer.step(1.0)
    saved_modules, saved_state = copy.deepcopy(modules), copy.deepcopy(optimizer.state_dict())
    resumed = MimoOptimizer(_OneProcess(saved_modules), BASE, per_module=PER_MODULE, schedule=SCHEDULE)
    resumed.load_state_dict(saved_state)
    assert resumed.lrs() == optimizer.lrs()
    for run, mods in ((optimizer, modules), (resumed, saved_modules)):
        _set_grads(mods, 2, 1e-3)
        run.step(1.0)
    for name in modules:
        for p, q in zip(modules[name].parameters(), saved_modules[name].parameters()):
            assert torch.equal(p, q), name


def _check_resumed(optimizer: MimoOptimizer, modules: dict[str, nn.Module], resumed: MimoOptimizer,
                   resumed_modules: dict[str, nn.Module], configs: dict[str, AdamWConfig], exempt) -> None:
    """One more step of `resumed` (loaded from `optimizer`'s state) against plain AdamW per module
    built from `configs` (`exempt(config, module)`: the names without weight decay), each
    parameter's moments copied from `optimizer`'s: every post-step weight alike."""
    reference_modules = copy.deepcopy(modules)
    _set_grads(reference_modules, 2, 1e-3)
    for name, module in reference_modules.items():
        config = configs[name]
        named, skip = dict(module.named_parameters()), exempt(config, module)
        reference = torch.optim.AdamW(
            [{"params": [p for n, p in named.items() if n not in skip], "weight_decay": config.weight_decay},
             {"params": [p for n, p in named.items() if n in skip], "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas, eps=config.eps)
        saved = optimizer.optimizers[name].state
        for (n, p), q in zip(named.items(), modules[name].parameters()):
            reference.state[p] = {k: v.clone() for k, v in saved[q].items()}
        reference.step()
    _set_grads(resumed_modules, 2, 1e-3)
    resumed.step(0.1)
    for name in modules:
        for (n, p), q in zip(resumed_modules[name].named_parameters(), reference_modules[name].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}.{n}: {m}")


def test_state_dict_resumes_with_this_runs_config() -> None:
    """A run resumed from `state_dict()` under a config of other hyperparameters (weight decay,
    betas, eps of a module) steps with them, as it does with its new lr and as a resume from a
    DCP checkpoint (which holds the moments only) does: the saved moments and step counts, the
    resumed run's config. Reference: plain AdamW per module built from the new config, its
    moments copied from the first run's."""
    modules = _all_modules()
    optimizer = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE)
    for seed in range(2):
        _set_grads(modules, seed, 1e-3)
        optimizer.step(0.1)
    new_base = dataclasses.replace(BASE, betas=(0.5, 0.6), eps=1e-4, weight_decay=0.7)
    new_vision = dataclasses.replace(PER_MODULE["vision"], weight_decay=0.0, betas=(0.7, 0.8))
    resumed_modules = copy.deepcopy(modules)
    resumed = MimoOptimizer(_OneProcess(resumed_modules), new_base,
                            per_module={"vision": new_vision, "audio": PER_MODULE["audio"]})
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    configs = {"vision": new_vision, "audio": PER_MODULE["audio"], "language": new_base}
    _check_resumed(optimizer, modules, resumed, resumed_modules, configs,
                   lambda config, module: set() if config.no_decay is None else _no_decay_names(module))


def test_state_dict_resumes_under_another_no_decay() -> None:
    """`no_decay` is a hyperparameter like the others: a run resumed from `state_dict()` whose
    config exempts other parameters from weight decay (None: every parameter decays; or one more
    name) takes each parameter's saved moments and count, and steps with its own groups, as a resume
    from a DCP checkpoint does (torch's positional load refused it: "loaded state dict has a
    different number of parameter groups"). Reference: plain AdamW per module built from the new
    config, each parameter's moments copied from the first run's by name."""
    modules = _all_modules()
    optimizer = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE)
    for seed in range(2):
        _set_grads(modules, seed, 1e-3)
        optimizer.step(0.1)
    new_base = dataclasses.replace(BASE, no_decay=None)
    new_vision = dataclasses.replace(PER_MODULE["vision"], no_decay=("embed", "projection"))
    new_audio = dataclasses.replace(PER_MODULE["audio"], no_decay=("embed",))
    configs = {"vision": new_vision, "audio": new_audio, "language": new_base}
    resumed_modules = copy.deepcopy(modules)
    resumed = MimoOptimizer(_OneProcess(resumed_modules), new_base,
                            per_module={"vision": new_vision, "audio": new_audio})
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _check_resumed(optimizer, modules, resumed, resumed_modules, configs,
                   lambda config, module: {n for n, p in module.named_parameters() if config.no_decay is not None
                                           and (p.ndim < 2 or any(s in n for s in config.no_decay))})


def test_a_state_of_other_modules_is_refused_by_name() -> None:
    """`load_state_dict` of a state saved by an optimizer of other modules (a layout without the
    audio encoder, or with one more) is a ValueError naming both sets of modules, before any module's
    state is loaded: not a KeyError naming one module, nor the other modules' states loaded
    silently while the extra one is dropped; a module's state of other parameters names them."""
    modules = _all_modules()
    full = MimoOptimizer(_OneProcess(modules), BASE, per_module=PER_MODULE)
    _set_grads(modules, 0, 1e-3)
    full.step(0.1)
    fewer = {n: m for n, m in copy.deepcopy(modules).items() if n != "audio"}
    without_audio = MimoOptimizer(_OneProcess(fewer), BASE, per_module={"vision": PER_MODULE["vision"]})
    with pytest.raises(ValueError, match=r"the state holds modules \['language', 'vision'\], this rank's optimizer "
                                         r"\['audio', 'language', 'vision'\]"):
        full.load_state_dict(copy.deepcopy(without_audio.state_dict()))
    with pytest.raises(ValueError, match=r"the state holds modules \['audio', 'language', 'vision'\], this rank's "
                                         r"optimizer \['language', 'vision'\]"):
        without_audio.load_state_dict(copy.deepcopy(full.state_dict()))
    assert all(not opt.state for opt in without_audio.optimizers.values())  # nothing loaded
    state = copy.deepcopy(full.state_dict())
    state["names"]["vision"] = [n.replace("encoder.", "tower.") for n in state["names"]["vision"]]
    with pytest.raises(ValueError, match=r"module 'vision''s saved state is of other parameters than this rank's "
                                         r"\(missing \['encoder\."):
        MimoOptimizer(_OneProcess(copy.deepcopy(modules)), BASE, per_module=PER_MODULE).load_state_dict(state)


def test_config_errors() -> None:
    model = _OneProcess(_all_modules())
    with pytest.raises(ValueError, match=r"\['video'\] are not modules.*\['vision', 'audio', 'language'\]"):
        MimoOptimizer(model, BASE, per_module={"video": BASE})
    with pytest.raises(ValueError, match=r"\['vision'\].max_grad_norm=1.0 .*config.max_grad_norm=0.5"):
        MimoOptimizer(model, BASE, per_module={"vision": AdamWConfig(lr=1e-5)})
    with pytest.raises(ValueError, match="needs total_steps"):
        LRSchedule(warmup_steps=10, decay="cosine", total_steps=10)
    with pytest.raises(ValueError, match="warmup_start"):
        LRSchedule(warmup_start=2.0)
    with pytest.raises(TypeError, match="tuple of name substrings"):
        AdamWConfig(no_decay="embed")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"max_grad_norm=.* must be a positive number .* or None"):
            AdamWConfig(max_grad_norm=bad)
    # What torch.optim.AdamW refuses, refused when the config is made (a module's own config in
    # per_module would otherwise fail on that module's ranks only, the others waiting in the step)
    for bad in ((1.0, 0.95), (0.9, -0.1), (0.9, float("nan")), (0.9,), "ab"):
        with pytest.raises(ValueError, match=r"AdamWConfig.betas=.* must be two numbers in \[0, 1\)"):
            AdamWConfig(betas=bad)
    assert AdamWConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)  # a config file's list


def test_config_errors_name_a_value_that_is_not_a_number() -> None:
    """A string or None where a number belongs (a config file's "3e-4") is refused naming the field
    and the value, not by a comparison's bare TypeError ("'<=' not supported between ...")."""
    for field, bad in (("lr", "3e-4"), ("eps", None), ("weight_decay", "0.1"), ("max_grad_norm", "1.0")):
        with pytest.raises(TypeError, match=rf"AdamWConfig.{field}={bad!r}: must be a number"):
            AdamWConfig(**{field: bad})
    for field, bad in (("warmup_start", "0.1"), ("min_lr_ratio", None)):
        with pytest.raises(TypeError, match=rf"LRSchedule.{field}={bad!r}: must be a number"):
            LRSchedule(**{field: bad})
    assert AdamWConfig(lr=1, max_grad_norm=None).lr == 1  # an int is a number; None: no clipping


def test_schedule_step_counts_refuse_a_bool_and_take_a_numpy_integer() -> None:
    """`LRSchedule.warmup_steps` and `total_steps` are counts of updates: True was taken as one
    warmup step (and as total_steps=1) without a word, while `PipelineConfig` and `AdamWConfig`
    refuse a bool where a number belongs; a NumPy integer (a count computed with NumPy) was
    refused as "not an integer"."""
    import numpy as np

    for field, bad in (("warmup_steps", True), ("warmup_steps", False), ("total_steps", True), ("total_steps", 3.0)):
        with pytest.raises(ValueError, match=rf"LRSchedule.{field} must be an integer.*got {bad!r}"):
            LRSchedule(**{field: bad, "decay": "linear", **({} if field == "total_steps" else {"total_steps": 9})})
    schedule = LRSchedule(warmup_steps=np.int64(2), decay="linear", total_steps=np.int64(4))
    assert type(schedule.warmup_steps) is int and type(schedule.total_steps) is int
    assert [schedule.factor(s) for s in range(5)] == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0])

# ------------------------------------------------------------------ distributed


P = Parallelism
CASES = {
    "fsdp_allreduce": Case({"vision": P(dp=2), "audio": P(dp=2), "language": P(dp=2)},
                           offsets={"vision": 0, "audio": 0, "language": 2},
                           options={"audio": ParallelOptions(fsdp=False)}),
    "tp_colocated": Case({"vision": P(dp=2, tp=2), "language": P(tp=4)}, offsets={"vision": 0, "language": 0},
                         options={"vision": ParallelOptions(sp=True)}),
}


def _reference_run(encoders: tuple[str, ...]) -> list[dict]:
    llama, encs = _modules(encoders)
    modules = {**encs, "language": llama}
    reference = _Reference(modules)
    records = []
    for update, batch in enumerate(_batches(encoders, packed=False)):
        ids = batch.special_token_ids
        rows = {n: encs[n](m.inputs) for n, m in batch.modalities.items()}
        h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
        logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids)
        weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
        loss = (ce * weight).sum() / weight.sum()
        loss.backward()
        module_norms = {n: math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in m.parameters()))
                        for n, m in modules.items()}
        norm = reference.step(update)
        record = _record(loss.item(), norm, {n: dict(m.named_parameters()) for n, m in modules.items()})
        records.append({**record, "module_grad_norms": module_norms,
                        "lrs": {n: reference.peaks[n] * FACTORS[update] for n in modules}})
    assert any(r["grad_norm"] > BASE.max_grad_norm for r in records), "clipping never engaged"
    return records


def _distributed_run(case: Case) -> list[dict]:
    layout = case.layout()
    layout.init_meshes("cpu")
    llama, encs = _modules(case.encoders)
    model = MimoModel(layout, llama, encs, options=case.options)
    optimizer = MimoOptimizer(model, BASE, per_module={n: c for n, c in PER_MODULE.items() if n in encs},
                              schedule=SCHEDULE)
    rank, records = dist.get_rank(), []
    for batch in _batches(case.encoders, packed=False):
        lrs = optimizer.lrs()
        metrics = train_step(model, optimizer, batch)
        assert not metrics.skipped
        params = {m: model.module_parameters(m) for m in model.module_names}
        record = _record(metrics.loss, metrics.grad_norm, params)
        keep = {m for m in model.module_names  # the first rank of each module reports its weights
                if (c := layout.coordinate(m, rank)) is not None and c["dp"] == c["cp"] == c["tp"] == 0}
        record["weights"] = {k: v for k, v in record["weights"].items() if k.split(".")[0] in keep}
        records.append({**record, "module_grad_norms": metrics.module_grad_norms, "lrs": lrs})
    return records


@pytest.mark.parametrize("name", list(CASES))
def test_distributed_matches_reference(name: str) -> None:
    case = CASES[name]
    expected = _reference_run(case.encoders)
    per_rank = run_on_ranks(_distributed_run, case.layout().world_size, case, timeout=300)
    for step, want in enumerate(expected):
        weights = {}
        for records in per_rank:
            got = records[step]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"step {step}: loss"
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), f"step {step}: norm"
            assert got["module_grad_norms"] == pytest.approx(want["module_grad_norms"], rel=1e-5), step
            assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-12), f"step {step}: lrs"
            weights.update(got["weights"])
        assert weights.keys() == want["weights"].keys(), f"step {step}: weight names differ"
        for param, value in want["weights"].items():
            torch.testing.assert_close(weights[param], value, **TOL,
                                       msg=lambda m: f"step {step} {param}: {m}")


# ------------------------------------------------------------------ a hand-written loop


def _predict_between_backward_and_step() -> list[tuple[float, float]]:
    """vision dp2 and language dp2, both FSDP2 on ranks 0-1, trained by hand (docs/library.md):
    ``forward_backward``, ``reduce_gradients``, the global norm, ``optimizer.step(norm)``, with a
    `predict` (an evaluation) between each backward and its step. Each step's (loss, norm)."""
    from dtensor_mimo.optim.optimizer import grad_sumsq_shares

    case = Case({"vision": Parallelism(dp=2), "language": Parallelism(dp=2)}, offsets={"vision": 0, "language": 0})
    layout = case.layout()
    layout.init_meshes("cpu")
    model = MimoModel(layout, *_modules(case.encoders))
    optimizer = MimoOptimizer(model, OPT)
    batches = _batches(case.encoders, packed=False)
    out = []
    for batch in batches:
        optimizer.zero_grad()
        share = model.forward_backward(batch).double().reshape(1)
        if not model.holds_loss_share():
            share.zero_()
        model.reduce_gradients()
        totals = torch.cat([share, grad_sumsq_shares(model)])
        dist.all_reduce(totals)
        model.predict(batches[-1])  # leaves the FSDP2 roots' parameters gathered
        norm = totals[1:].sum().sqrt().item()
        assert optimizer.step(norm)
        out.append((totals[0].item(), norm))
    return out


def test_predict_between_backward_and_step() -> None:
    """The step after an update that followed a `predict` forwards the updated weights: the
    update writes the FSDP2 shards, and a forward that found the roots still gathered by the
    `predict` used the copy from before the update (the second step's loss and gradients were
    those of stale embeddings, norms and head). Reference: the single-process run."""
    expected = _reference(("vision",), False, ())
    for records in run_on_ranks(_predict_between_backward_and_step, 2, timeout=180):
        for step, (want, (loss, norm)) in enumerate(zip(expected, records)):
            assert loss == pytest.approx(want["loss"], rel=1e-5), f"step {step}: loss"
            assert norm == pytest.approx(want["grad_norm"], rel=1e-5), f"step {step}: norm"


def _norm_before_reduce_gradients() -> str | None:
    """vision on rank 0, language tp2 + sp on ranks 1-2, trained by hand with the gradient
    reduction forgotten: what `grad_sumsq_shares` says on this rank (no collective follows)."""
    from dtensor_mimo.optim.optimizer import grad_sumsq_shares

    case = Case({"vision": Parallelism(), "language": Parallelism(tp=2)},
                options={"language": ParallelOptions(sp=True)})
    layout = case.layout()
    layout.init_meshes("cpu")
    model = MimoModel(layout, *_modules(case.encoders), options=case.options)
    model.forward_backward(_batches(case.encoders, packed=False)[0])
    try:
        grad_sumsq_shares(model)
    except RuntimeError as e:
        return str(e)
    return None


def test_norm_before_reduce_gradients_is_refused_on_every_rank() -> None:
    """A hand-written loop that computes the norm without `model.reduce_gradients()` is refused on
    every rank alike, before the all-reduce of the norm: refused on the ranks whose gradients were
    still partial sums (the language model's sp norms) only, the vision rank went on into that
    all-reduce and waited for peers that had raised (on NCCL until the timeout)."""
    errors = run_on_ranks(_norm_before_reduce_gradients, 3, timeout=180)
    assert all(e is not None and "reduce_gradients()" in e for e in errors), errors


def _optimizers_of_other_models() -> list[str]:
    """On one rank: `train_step` with the optimizer of another model, and a `per_module` value
    that is no AdamWConfig: their errors."""
    case = Case({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    layout = case.layout()
    layout.init_meshes("cpu")
    model, other = (MimoModel(layout, *_modules(case.encoders)) for _ in range(2))
    errors = []
    try:
        train_step(model, MimoOptimizer(other, OPT), _batches(case.encoders, packed=False)[0])
    except ValueError as e:
        errors.append(str(e))
    try:
        MimoOptimizer(model, OPT, per_module={"vision": {"lr": 1e-3}})
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_an_optimizer_of_another_model_and_a_per_module_dict_are_refused_by_name() -> None:
    """`train_step(model, optimizer_of_another_model, batch)` stepped nothing of `model`, silently;
    ``per_module={"vision": {"lr": ...}}`` failed with an AttributeError naming nothing."""
    (errors,) = run_on_ranks(_optimizers_of_other_models, 1, timeout=120)
    assert len(errors) == 2, errors
    assert "built for another MimoModel" in errors[0]
    assert "per_module['vision']" in errors[1] and "AdamWConfig" in errors[1]
