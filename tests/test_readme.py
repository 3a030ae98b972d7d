"""The README stays true: its library example runs, its config is the example file, and the
trainer's docs list every key `--help` lists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dtensor_mimo.train.config import help_text, parse_args, tomllib

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_library_example_runs_on_three_ranks(tmp_path) -> None:
    blocks = _blocks(_read("README.md"), "python")
    code = next(b for b in blocks if "train_step(model, optimizer, batch)" in b)
    # Its process groups torn down before the interpreter exits (a rank once aborted at exit under
    # load with them alive: "terminate called without an active exception"), after the programs
    # the README prints for that model, each rank's written to a file.
    code, teardown = code.split("dist.destroy_process_group()")
    # Each rank's printed line to a file of its own: ranks printing into one pipe interleave their
    # lines piece by piece under load, whatever the buffering.
    assert code.count("print(metrics.loss, metrics.grad_norm)") == 1
    code = code.replace("print(metrics.loss, metrics.grad_norm)",
                        "open(f'metrics.{dist.get_rank()}', 'w').write(f'{metrics.loss} {metrics.grad_norm}')")
    shown = next(b for b in blocks if "format_program(model.program(batch" in b)
    code += shown.replace("print(format_program(", "open(f'program.{dist.get_rank()}', 'w').write(format_program(")
    code += "\ndist.destroy_process_group()" + teardown
    script = tmp_path / "example.py"
    script.write_text(code)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node=3", str(script)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"metrics.{rank}").read_text() for rank in range(3)]
    assert len(set(lines)) == 1  # loss and grad norm, the same on every rank
    loss, norm = map(float, lines[0].split())
    assert 0 < loss < 20 and norm > 0
    comments = " ".join(line.lstrip("# ") for line in shown.splitlines() if line.startswith("#"))
    said = {int(m.group(1)): " ".join(m.group(2).split())
            for m in re.finditer(r"rank (\d) \([^)]*\): (.*?)(?= rank \d|$)", comments)}
    assert sorted(said) == [0, 1]
    for rank, program in said.items():
        assert (tmp_path / f"program.{rank}").read_text() == program, rank


def test_readme_config_is_the_example_file() -> None:
    shown = next(b for b in _blocks(_read("README.md"), "toml") if "[model.language]" in b)
    assert tomllib.loads(shown) == tomllib.loads(_read("examples", "llava_tiny.toml"))


def test_trainer_docs_list_every_key() -> None:
    docs = _read("docs", "trainer.md")
    keys = re.findall(r"^  (--\S+)", help_text(), re.M)
    assert len(keys) > 60
    missing = [k for k in keys if k not in docs]
    assert not missing, f"docs/trainer.md lacks {missing}: regenerate its key list from --help"
    # Each line as --help prints it ("`python -m dtensor_mimo.train --help` prints this list").
    listed = {" ".join(line.split()) for line in _blocks(docs, "text")[0].splitlines()}
    differ = [k for k, line in zip(keys, re.findall(r"^  (--.*)$", help_text(), re.M))
              if " ".join(line.split()) not in listed]
    assert not differ, f"docs/trainer.md's lines for {differ} differ from --help's: regenerate them"


def test_tiny_data_command_writes_the_video_files(tmp_path) -> None:
    """docs/trainer.md's and examples/llava_video_tiny.toml's command, `make_tiny_llava.py --out DIR
    --video N` (here with few samples): it writes N training clips and N // 4 held-out ones beside
    the image files, whose images stay 16x16."""
    pytest.importorskip("av")
    pytest.importorskip("transformers")
    image = pytest.importorskip("PIL.Image")
    out = tmp_path / "tiny"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_llava.py"), "--out", str(out),
                          "--train", "4", "--val", "2", "--audio", "0", "--video", "8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for name, count in (("video_train", 8), ("video_val", 2), ("train", 4), ("val", 2)):
        lines = (out / "data" / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == count, name
    sample = json.loads((out / "data" / "train.jsonl").read_text().splitlines()[0])
    for path in [sample["image"]] if isinstance(sample.get("image"), str) else sample.get("image", []):
        assert image.open(out / "data" / path).size == (16, 16)


def _help_line(key: str) -> str:
    return next(" ".join(line.split()) for line in help_text().splitlines() if line.strip().startswith(key + " "))


def test_documented_default_of_image_max_pixels_is_the_trainers() -> None:
    """`data.image_max_pixels = 0` resizes images into `max_patches` patches when the encoder sets
    max_patches (`dynamic_vit`), the tower's image_size squared only otherwise: --help (and so
    docs/trainer.md) and the README's key table say both."""
    from dtensor_mimo.models import ViTConfig
    from dtensor_mimo.train.modules import dynamic_vit

    argv = ["--data.format", "llava", "--data.path", "train.jsonl", "--data.tokenizer", "tok",
            "--model.encoders.image.image_size", "16", "--model.encoders.image.dynamic_resolution", "true"]
    tower = ViTConfig(image_size=16, patch_size=4, dim=32, n_layers=1, n_heads=2)
    assert dynamic_vit(parse_args(argv), "image", tower)[1] == (16, 16 * 16)  # the tower's image_size squared
    capped = parse_args([*argv, "--model.encoders.image.max_patches", "36"])
    assert dynamic_vit(capped, "image", tower)[1] == (16, 36 * 4 * 4)  # max_patches patches of 4x4
    line = _help_line("--data.image_max_pixels")
    assert "max_patches" in line, line
    table = next(row for row in _read("README.md").splitlines() if row.startswith("| `data.image_max_pixels`"))
    assert "max_patches" in table, table


def test_documented_digits_seq_len_is_a_minimum() -> None:
    """The digits job's rows hold its longest sample whatever `data.seq_len` says (a shorter one is
    raised to it, not refused): --help says so, and the README's example of it is that."""
    from dtensor_mimo.train.datasets import digits_data
    from dtensor_mimo.train.modules import resolve

    longest = digits_data(parse_args([]), resolve(parse_args([]))).seq_len
    short = parse_args(["--data.seq_len", str(longest - 5)])
    assert digits_data(short, resolve(short)).seq_len == longest
    varied = ["--model.encoders.vision.dynamic_resolution", "true", "--model.encoders.audio.variable_length", "true"]
    given = parse_args([*varied, "--data.seq_len", "40"])
    rows = digits_data(given, resolve(given)).seq_len
    assert rows > 40
    line = _help_line("--data.seq_len")
    assert "digits: at least the longest sample's" in line, line
    assert f"`data.seq_len = 40` gives rows of {rows}" in " ".join(_read("README.md").split()), rows


def test_testing_doc_counts_the_oracle_layouts() -> None:
    """docs/testing.md's count of tests/test_mimo.py's layouts and of those built on the meta device."""
    from tests.test_mimo import CASES

    text = " ".join(_read("docs", "testing.md").split())
    said = re.search(r"`tests/test_mimo.py` is the oracle: (\d+) layouts", text)
    assert said and int(said.group(1)) == len(CASES), (said and said.group(1), len(CASES))
    meta = re.search(r"; (\w+) of them built on the meta device", text)
    words = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}
    assert meta and words.get(meta.group(1)) == sum(1 for c in CASES.values() if c.meta)


def test_documented_warmup_cut_follows_the_schedules_length() -> None:
    """A warmup not shorter than the schedule (`lr_schedule.total_steps`, train.steps unless given) is
    cut to half of it; a short run on a longer schedule keeps its warmup: --help says which."""
    assert parse_args(["--train.steps", "20"]).lr_schedule.warmup_steps == 10  # the digits job's 50, cut
    longer = parse_args(["--train.steps", "20", "--lr_schedule.total_steps", "1000"]).lr_schedule
    assert longer.warmup_steps == 50 and longer.total_steps == 1000
    shorter = parse_args(["--train.steps", "100", "--lr_schedule.total_steps", "40"]).lr_schedule
    assert shorter.warmup_steps == 20
    line = _help_line("--lr_schedule.warmup_steps")
    assert "a schedule (total_steps) not longer than that warms up for half of it" in line, line


def test_readme_cluster_table_is_the_paper_planners() -> None:
    """The README's "At cluster scale, on paper" figures are `python -m dtensor_mimo.plan.paper`'s
    predictions for its three workloads: each row's step times (first choice, best homogeneous,
    encoder on ranks of its own), the best homogeneous steps without HSDP, and the cut HSDP makes
    in the best homogeneous step (the README once rounded 2.475 s to 2.48 and gave the first
    choice's cut, 12-20 %, as the homogeneous one's)."""
    from dtensor_mimo.plan.cost import predict
    from dtensor_mimo.plan.paper import H100, best_uniform, paper_job, uniform_layouts
    from dtensor_mimo.plan.search import search

    readme = _read("README.md")
    text = " ".join(readme.split())
    rows = [r for r in readme.splitlines() if re.match(r"\| \d+ images?( \(\d+ patches\))?, \d+-token rows", r)]
    assert len(rows) == 3, rows
    device = H100.device()
    plain, cuts, idle = [], [], []
    for row in rows:
        images, seq_len, batch = map(int, re.match(r"\| (\d+) images?.*?, (\d+)-token rows \((\d+)\)", row).groups())
        said = [float(s) for s in re.findall(r"\| ([\d.]+) s\b", row)]
        job = paper_job(batch_size=batch, seq_len=seq_len, images_per_sample=images)
        ranked = search(job, 64, device).ranked
        own = next(p for p in ranked if p.fits and not p.candidate.shares_ranks("vision", "language"))
        best = best_uniform(job, 64, device)
        assert said == [round(p.step_s, 2) for p in (ranked[0], best, own)], (row, ranked[0], best, own)
        idle.append(100 * own.idle["vision"])
        without = min(p.step_s for p in (predict(job, c, device) for c in uniform_layouts(job, 64)) if p.fits)
        plain.append(round(without, 2))
        cuts.append(100 * (1 - best.step_s / without))
    said = re.search(r"InfiniBand\) predict ([\d.]+), ([\d.]+) and ([\d.]+) s", text)
    assert said and [float(s) for s in said.groups()] == plain, (said and said.groups(), plain)
    cut = re.search(r"cuts the best homogeneous layout's predicted step by (\d+)-(\d+) %", text)
    assert cut and [int(c) for c in cut.groups()] == [round(min(cuts)), round(max(cuts))], \
        (cut and cut.groups(), cuts)
    said = re.search(r"where it would idle (\d+)-(\d+) % of the step", text)
    assert said and [int(i) for i in said.groups()] == [round(min(idle)), round(max(idle))], (said, idle)


def _train_digits(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "--steps", "1",
                           "--batch-size", "2", "--eval-samples", "4", *flags],
                          capture_output=True, text=True, timeout=300, env=env)


def test_train_digits_task_tuple_fields() -> None:
    """examples/train_digits.py's --task takes DigitsTask's tuple fields (amplitude, twist) as pairs
    of numbers; they reached DigitsTask as tuples of characters (a bare unpacking error)."""
    import importlib.util

    run = _train_digits("--task", "amplitude=0.1,0.5")
    assert run.returncode == 0, run.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("train_digits", os.path.join(ROOT, "examples", "train_digits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = module.parse_task(["amplitude=0.1,0.5", "twist=(0.7, 0.9)", "max_images=2", "noise_std=0.25"])
    assert (task.amplitude, task.twist, task.max_images, task.noise_std) == ((0.1, 0.5), (0.7, 0.9), 2, 0.25)


@pytest.mark.parametrize("flags, said", [
    (("--task", "max_images"), "--task 'max_images': write FIELD=VALUE"),
    (("--task", "max_images=1.5"), "max_images takes int value like max_images=3"),
    (("--task", "maximages=1"), "DigitsTask has no field 'maximages'"),
    (("--task", "amplitude=0.5"), "amplitude takes tuple values like amplitude=0.2,1.0"),
    (("--task", "image_fit=stretch"), "image_fit has no effect here"),  # only for a dynamic-resolution ViT
    (("--patch-size", "3"), "--patch-size 3 does not divide the scans' image size 8"),  # silently cropped
    (("--eval-every", "0"), "--eval-every 0: give a number >= 1"),  # ZeroDivisionError
])
def test_train_digits_refuses_bad_flags(flags, said) -> None:
    """Flags the script cannot honour are refused with a message naming them, not ignored (image_fit,
    a patch leaving pixels unseen) or crashing with an error that names nothing."""
    run = _train_digits(*flags)
    assert run.returncode == 2 and said in run.stderr, run.stderr[-2000:]
