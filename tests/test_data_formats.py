"""The same conversations in every input format give the same batches and the same training.

One tiny corpus (examples/make_tiny_llava.py: coloured-shape images, one or two a sample, and
text-only samples) is written as the reference JSON list and again as:

| format        | written as                                                         |
|---------------|--------------------------------------------------------------------|
| llava         | one JSONL file; three JSONL shards named by a glob; a list of them |
| webdataset    | two tar shards: KEY.json + KEY.png / KEY.0.png, KEY.1.png members  |
| hf            | a save_to_disk directory (images as bytes); Parquet files (paths)  |

| test                                        | what                                                            |
|---------------------------------------------|-----------------------------------------------------------------|
| test_every_format_gives_the_json_batches    | token ids, labels, item counts and image tensors at the same indices == the JSON file's; lengths equal |
| test_every_format_trains_to_the_same_losses | 4 trainer steps from each format: losses bit-identical to JSONL's |
| test_format_errors_name_the_input           | a glob matching nothing, a tar sample without .json, an hf dataset without conversations: the launcher's config error names what was written and the fix, before any rank |
| test_sources_read_lazily                    | a source indexes only the files its first samples need; blank lines and a last line without newline in JSONL |
| test_tar_headers_read_as_tarfile_reads_them | the tar index's header walk == tarfile's members (ustar, GNU, pax names); gzip / truncated refused |
| test_parquet_rows_are_found_in_their_row_groups | rows of a file of many small and empty row groups, read in any order |
| test_sixteen_bit_grey_images_keep_their_shades | 16-bit grey PNG / TIFF: value x 255 / 65535, not clipped |
| test_images_are_read_as_their_exif_orientation_shows_them | EXIF orientation 6: pixels, header shape turned |
| test_transparent_images_are_what_transformers_... | RGBA / LA / palette: over white, as the processor |
| test_images_at_their_own_size_are_not_padded_... | dynamic resolution, do_pad: the image's own pixels |
| test_a_dataset_directory_with_a_trailing_slash_finds_the_same_media | 'data/hf/' and 'data/hf': media under data/ |
| test_a_corrupt_parquet_row_group_names_the_file_and_row | a damaged row group: DataError naming the file and row |
| test_a_tar_sample_missing_its_member_is_broken_media | past the head: MediaError on its row; left out, it builds |
| test_a_corpus_of_more_files_than_may_be_open_reads_through | 150 files, room for 100 open: JSONL, tar, Parquet |
| test_parquet_files_read_keep_a_bounded_number_of_row_groups | Arrow memory after 400 files < half their groups |
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import tarfile

import pytest
import torch

from tests.harness import run_on_ranks
from tests.test_train_llava import ROOT, make  # the tiny checkpoints and data writer

pytest.importorskip("transformers")
pytest.importorskip("PIL")
datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")

CONFIG = os.path.abspath(os.path.join(ROOT, "examples", "llava_tiny.toml"))

SAMPLES = 40


def _images(sample: dict) -> list[str]:
    value = sample.get("image", [])
    return [value] if isinstance(value, str) else list(value)


def _write_tar(path: str, samples: list[dict], data: str) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            key = sample["id"].replace("-", "_")
            paths = _images(sample)
            names = ["png"] if len(paths) == 1 else [f"{k}.png" for k in range(len(paths))]
            record = {k: v for k, v in sample.items() if k != "image"}
            if paths:
                record["image"] = names[0] if len(paths) == 1 else [f"{key}.{n}" for n in names]  # both spellings
            members = [(f"{key}.json", json.dumps(record).encode())]
            members += [(f"{key}.{n}", open(os.path.join(data, p), "rb").read()) for n, p in zip(names, paths)]
            for name, payload in members:
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, list[str]]:
    """The tiny checkpoints and one corpus in every format: ``{name: extra argv}``."""
    out = str(tmp_path_factory.mktemp("formats"))
    make.write_checkpoints(out)
    make.write_data(out, train=SAMPLES, val=8)
    data = os.path.join(out, "data")
    samples = [json.loads(line) for line in open(os.path.join(data, "train.jsonl"))]
    with open(os.path.join(data, "train.json"), "w") as f:
        json.dump(samples, f, indent=1)
    for k, part in enumerate((samples[:13], samples[13:30], samples[30:])):
        with open(os.path.join(data, f"shard-{k}.jsonl"), "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in part)
    _write_tar(os.path.join(data, "train-0.tar"), samples[:25], data)
    _write_tar(os.path.join(data, "train-1.tar"), samples[25:], data)
    columns = {"id": [s["id"] for s in samples], "conversations": [s["conversations"] for s in samples]}
    with_bytes = datasets.Dataset.from_dict({**columns, "image": [[open(os.path.join(data, p), "rb").read()
                                                                   for p in _images(s)] for s in samples]})
    with_bytes.save_to_disk(os.path.join(data, "hf"))
    with_paths = datasets.Dataset.from_dict({**columns, "image": [_images(s) for s in samples]})
    with_paths.select(range(20)).to_parquet(os.path.join(data, "part-0.parquet"))
    with_paths.select(range(20, SAMPLES)).to_parquet(os.path.join(data, "part-1.parquet"))
    with_paths.remove_columns("conversations").save_to_disk(os.path.join(data, "no_conversations"))
    llava = ["--data.format", "llava", "--data.root", "data"]
    return {"dir": out,
            "json": [*llava, "--data.path", "data/train.json"],
            "jsonl": [*llava, "--data.path", "data/train.jsonl"],
            "jsonl glob": [*llava, "--data.path", "data/shard-*.jsonl"],
            "jsonl list": [*llava, "--data.path", '["data/shard-0.jsonl", "data/shard-1.jsonl", "data/shard-2.jsonl"]'],
            "webdataset": ["--data.format", "webdataset", "--data.path", "data/train-*.tar", "--data.root", "none"],
            "hf dir (bytes)": ["--data.format", "hf", "--data.path", "data/hf"],
            "hf parquet (paths)": ["--data.format", "hf", "--data.path", "data/part-*.parquet", "--data.root", "data"]}


FORMATS = ["jsonl", "jsonl glob", "jsonl list", "webdataset", "hf dir (bytes)", "hf parquet (paths)"]


def _data(cwd: str, argv: list[str]):
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    here = os.getcwd()
    os.chdir(cwd)
    try:
        config = parse_args(["--config", CONFIG, *argv, "--data.heldout", "none"])
        return train_data(config, resolve(config))
    finally:
        os.chdir(here)


def test_every_format_gives_the_json_batches(corpus) -> None:
    reference = _data(corpus["dir"], corpus["json"])
    indices = [3, 0, 17, 39, 25, 12, 24, 30]  # across every shard boundary
    want = reference.train.batch(indices)
    assert want.modalities["image"].items_per_sample.count(2) >= 1  # two-image samples are in it
    for name in FORMATS:
        got = _data(corpus["dir"], corpus[name])
        assert len(got.train) == len(reference.train) == SAMPLES, name
        batch = got.train.batch(indices)
        assert torch.equal(batch.tokens, want.tokens) and torch.equal(batch.labels, want.labels), name
        m, w = batch.modalities["image"], want.modalities["image"]
        assert m.items_per_sample == w.items_per_sample, name
        assert torch.equal(m.inputs, w.inputs), name
        assert [got.train[i].id for i in indices] == [reference.train[i].id for i in indices], name
        # a rank that encodes only some samples of the batch: the same rows, only those samples' pixels
        # (each at its own items; every other item zeros)
        offsets = [0, *itertools.accumulate(w.items_per_sample)]
        for loaded in ([2], [0, 2, 3, 6]):
            part = got.train.batch(indices, load={"image": loaded})
            assert torch.equal(part.tokens, want.tokens)
            expected = torch.zeros_like(w.inputs)
            for r in loaded:
                expected[offsets[r]:offsets[r + 1]] = w.inputs[offsets[r]:offsets[r + 1]]
            assert torch.equal(part.modalities["image"].inputs, expected), (name, loaded)
        assert got.items_per_sample == reference.items_per_sample, name


def _losses(cwd: str, runs: dict[str, list[str]], common: list[str]) -> dict[str, list[float]]:
    """One process: a trainer run per format, its JSONL losses."""
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    here = os.getcwd()
    os.chdir(cwd)
    out = {}
    try:
        for name, argv in runs.items():
            path = os.path.join(cwd, f"{name}.jsonl".replace(" ", "_"))
            Trainer(parse_args(["--config", CONFIG, *argv, *common, "--metrics.jsonl", path])).run()
            with open(path) as f:
                out[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    finally:
        os.chdir(here)
    return out


def test_every_format_trains_to_the_same_losses(corpus) -> None:
    common = ["--metrics.progress", "off", "--train.generate", "0", "--metrics.log_every", "1", "--train.steps", "4",
              "--data.batch_size", "8", "--pipeline.microbatches", "1", "--checkpoint.export_hf", "none",
              "--data.heldout", "none", "--layout.language.offset", "0", "--lr_schedule.warmup_steps", "1"]
    runs = {name: corpus[name] for name in ["jsonl", "jsonl glob", "webdataset", "hf dir (bytes)",
                                             "hf parquet (paths)"]}
    losses = run_on_ranks(_losses, 1, corpus["dir"], runs, common, timeout=300)[0]
    assert len(losses["jsonl"]) == 4
    for name, got in losses.items():
        assert got == losses["jsonl"], name  # the same batches: bit-identical


def _config_error(cwd: str, argv: list[str], capsys) -> str:
    from dtensor_mimo.train.launch import main

    here = os.getcwd()
    os.chdir(cwd)
    try:
        assert main(["--config", CONFIG, *argv]) == 2  # refused by the launcher: no rank started
    finally:
        os.chdir(here)
    return capsys.readouterr().err


def test_format_errors_name_the_input(corpus, tmp_path, capsys) -> None:
    err = _config_error(corpus["dir"], ["--data.path", "data/nothing-*.jsonl"], capsys)
    assert "data.path = 'data/nothing-*.jsonl'" in err and "matches no file" in err and "fix the pattern" in err
    bad = os.path.join(corpus["dir"], "data", "bad.tar")
    with tarfile.open(bad, "w") as tar:
        for name in ("a.json", "b.png"):
            info = tarfile.TarInfo(name)
            payload = b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    err = _config_error(corpus["dir"], ["--data.format", "webdataset", "--data.path", "data/bad.tar", "--data.root", "none"],
                        capsys)
    assert "data.path = 'data/bad.tar'" in err and "sample 'b' has no .json member (it has b.png)" in err
    assert "b.json" in err
    err = _config_error(corpus["dir"], ["--data.format", "hf", "--data.path", "data/no_conversations"], capsys)
    assert "data.path = 'data/no_conversations'" in err and "no 'conversations' column" in err
    assert "rename_column" in err


def test_sources_read_lazily(corpus) -> None:
    from dtensor_mimo.data.sources import open_source

    cwd = os.getcwd()
    os.chdir(corpus["dir"])
    try:
        source = open_source("llava", "data/shard-*.jsonl", "data")
        assert [s["id"] for s in source.head(3)] == ["train-0", "train-1", "train-2"]
        assert source._lines == {}  # the head was read without indexing any file
        assert source[14]["id"] == "train-14" and sorted(source._lines) == [0, 1]  # the third shard untouched
        assert len(source) == SAMPLES and source.first(5)[4]["id"] == "train-4" and len(source.first(5)) == 5
        # blank and whitespace-only lines skipped, the last line without its newline
        conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
        with open("data/gaps.jsonl", "w") as f:
            f.write("\n".join(["", json.dumps({"id": "a", "conversations": conv}), "   ", "",
                               json.dumps({"id": "b", "conversations": conv}), " \t\r",
                               "  " + json.dumps({"id": "c", "conversations": conv})]))
        gaps = open_source("llava", "data/gaps.jsonl", None)
        assert [s["id"] for s in gaps.head(9)] == ["a", "b", "c"]
        assert len(gaps) == 3 and [gaps[i]["id"] for i in range(3)] == ["a", "b", "c"]
        tars = open_source("webdataset", "data/train-*.tar", None)
        assert tars[3]["id"] == "train-3" and sorted(tars._shards) == [0]
        ref = tars.media(3, tars[3], "image")[0] if tars[3].get("image") else None
        if ref is not None:
            assert ref.startswith(os.path.abspath(os.path.join("data", "train-0.tar")) + "[")
    finally:
        os.chdir(cwd)


def test_files_starting_with_a_byte_order_mark_read_as_without(tmp_path) -> None:
    """A UTF-8 byte-order mark (what Windows tools write first) before a JSON list, indented or on
    one line, or before a JSONL file (on the first sample's line, or alone on a line of its own):
    the same samples (a list was taken for JSONL)."""
    from dtensor_mimo.data.sources import open_source

    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    samples = [{"id": f"s{k}", "conversations": conv} for k in range(3)]
    texts = {"list.json": json.dumps(samples), "indented.json": json.dumps(samples, indent=1),
             "lines.jsonl": "\n".join(map(json.dumps, samples)),
             "alone.jsonl": "\n" + "\n".join(map(json.dumps, samples)), "blank.jsonl": " \n\n" + json.dumps(samples[0])
             + "\n" + "\n".join(map(json.dumps, samples[1:]))}
    for name, text in texts.items():
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        for fresh in (True, False):  # the head before any index; then the indexed file
            source = open_source("llava", str(tmp_path / name), None)
            got = [s["id"] for s in source.head(5)] if fresh else [source[i]["id"] for i in range(len(source))]
            assert got == ["s0", "s1", "s2"], (name, fresh, got)


def _tar(path, format_: int, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=format_) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, kind in (("a-directory", tarfile.DIRTYPE), ("a-link.json", tarfile.SYMTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "a.json"
            tar.addfile(info)


@pytest.mark.parametrize("format_", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_headers_read_as_tarfile_reads_them(tmp_path, format_) -> None:
    """The shard index's own header walk (`_tar_members`) lists what `tarfile` lists: names in
    the ustar prefix, GNU long names, pax paths (non-ASCII, long), empty and block-sized
    members; directories and links left out. A compressed or truncated file is refused."""
    from dtensor_mimo.data.sources import _tar_members

    members = [("a.json", b"{}"), ("a.png", b"x" * 513), ("empty.json", b""), ("b/c.json", b"1" * 512),
               ("p" * 90 + "/" + "q" * 90 + ".json", b"q")]
    if format_ != tarfile.USTAR_FORMAT:  # names ustar cannot hold
        members += [("d" * 150 + "/long.json", b"abc"), ("é-ünï.json", b"u"), ("x" * 120 + ".json", b"z" * 1000)]
    path = str(tmp_path / "shard.tar")
    _tar(path, format_, members)
    with tarfile.open(path, "r:") as tar:
        expected = [(i.name, i.offset_data, i.size) for i in tar if i.isfile()]
    assert _tar_members(path) == expected and [m[0] for m in expected] == [n for n, _ in members]
    data = open(path, "rb").read()
    for name, broken in (("gz.tar", __import__("gzip").compress(data)), ("cut.tar", data[:1100])):
        (tmp_path / name).write_bytes(broken)
        with pytest.raises(tarfile.ReadError):
            _tar_members(str(tmp_path / name))


def test_parquet_rows_are_found_in_their_row_groups(tmp_path) -> None:
    """Rows read from a Parquet file of many small (and empty) row groups, in any order: each
    the row written (the groups' first rows come from the metadata once)."""
    import pyarrow as pa

    from dtensor_mimo.data.sources import _Table

    path = str(tmp_path / "t.parquet")
    schema = pa.schema([("conversations", pa.string()), ("n", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        start = 0
        for size in (3, 0, 1, 5, 2):
            writer.write_table(pa.table({"conversations": [f"row {start + i}" for i in range(size)],
                                         "n": list(range(start, start + size))}, schema=schema))
            start += size
    table = _Table(path, "data.path")
    assert table.rows == 11
    for j in (10, 0, 3, 4, 2, 9, 8, 5):
        assert table.row(j) == {"conversations": f"row {j}", "n": j}


def test_tar_sparse_members_and_malformed_pax_records_are_refused(tmp_path) -> None:
    """A GNU sparse member (old GNU headers or pax's GNU.sparse records: its data is not at one
    offset) and a pax record of length 0 (which never advances) raise, never index silently
    short or loop."""
    import shutil
    import subprocess

    from dtensor_mimo.data.sources import _pax, _tar_members

    with pytest.raises(tarfile.ReadError, match="malformed pax record"):
        _pax(b"0 path=abc\n")
    assert _pax(b"12 path=abc\n13 size=1234\n") == {"path": "abc", "size": 1234}
    if shutil.which("tar") is None or b"GNU" not in subprocess.run(["tar", "--version"], capture_output=True).stdout:
        pytest.skip("GNU tar writes the sparse shards")
    with open(tmp_path / "s.bin", "wb") as f:
        for i in range(8):
            f.seek(i * 1_000_000)
            f.write(b"x" * 10)
    (tmp_path / "s.json").write_text("{}")
    for format_ in ("gnu", "pax"):
        subprocess.run(["tar", "--sparse", f"--format={format_}", "-cf", f"{format_}.tar", "s.bin", "s.json"],
                       cwd=tmp_path, check=True)
        with pytest.raises(tarfile.ReadError, match="GNU sparse file"):
            _tar_members(str(tmp_path / f"{format_}.tar"))


def test_tar_media_found_when_names_hold_brackets(tmp_path) -> None:
    """A media reference is "{shard}[{member}]": a shard path and a sample key that hold brackets
    themselves still open the member written."""
    from dtensor_mimo.data.sources import open_source

    conv = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "yo"}]
    (tmp_path / "set[1]").mkdir()
    path = str(tmp_path / "set[1]" / "shard[0].tar")
    _tar(path, tarfile.PAX_FORMAT, [("a[2]/b[3].json", json.dumps({"conversations": conv, "image": "png"}).encode()),
                                    ("a[2]/b[3].png", b"the image")])
    source = open_source("webdataset", path, None)
    ref, = source.media(0, source[0], "image")
    assert source[0]["id"] == "a[2]/b[3]" and source.open(ref).read() == b"the image"


class _Pixels:
    """An image processor that keeps an image's pixels as they are (``[N, 3, H, W]``); with a
    size, resized to it (nearest) as a fitting processor does."""

    def __call__(self, images, return_tensors: str, size: dict | None = None, **_) -> dict[str, torch.Tensor]:
        import numpy as np

        if size is not None:
            images = [im.resize((size["width"], size["height"]), 0) for im in images]
        return {"pixel_values": torch.tensor(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2)}


def test_sixteen_bit_grey_images_keep_their_shades(tmp_path) -> None:
    """A 16-bit greyscale PNG or TIFF (Pillow's mode I;16: scans, depth maps, medical images)
    goes to the processor as the 8-bit image it shows: each value scaled by 255 / 65535, not
    clipped at 255 (which turns every pixel above 255 of 65535 white)."""
    import numpy as np
    from PIL import Image

    from dtensor_mimo.data.conversation import image_inputs

    grey = (np.arange(32, dtype=np.uint16).reshape(4, 8) * 2113).astype(np.uint16)  # 0 .. 65503
    expected = torch.tensor(np.rint(grey / 257.0).astype(np.uint8))[None].expand(3, 4, 8).float()
    for name in ("g16.png", "g16.tif"):
        Image.fromarray(grey).save(tmp_path / name)
        with Image.open(tmp_path / name) as image:
            assert image.mode.startswith("I;16")
        pixels = image_inputs(_Pixels())([str(tmp_path / name)])
        assert torch.equal(pixels[0], expected), name


def test_images_are_read_as_their_exif_orientation_shows_them(tmp_path) -> None:
    """A photo whose camera was turned (EXIF Orientation 6: stored on its side, shown turned 90
    degrees clockwise) is the image shown, as every viewer and the annotator saw it: its
    pixels, and with items of their own size its header's shape, height and width swapped."""
    import numpy as np
    from PIL import Image

    from dtensor_mimo.data.conversation import image_inputs

    stored = np.zeros((16, 32, 3), dtype=np.uint8)  # 16 high, 32 wide: left half red, right half blue
    stored[:, :16, 0] = stored[:, 16:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    for name in ("turned.png", "turned.jpg", "turned.webp"):
        Image.fromarray(stored).save(tmp_path / name, exif=exif, quality=95)
        with Image.open(tmp_path / name) as image:  # the stored pixels (a JPEG's as decoded), turned here
            decoded = np.asarray(image.convert("RGB"))
        shown = torch.tensor(np.rot90(decoded, k=-1).copy()).permute(2, 0, 1).float()  # 32 high, 16 wide: red on top
        assert torch.equal(image_inputs(_Pixels())([str(tmp_path / name)])[0], shown), name
        fitted = image_inputs(_Pixels(), fit=(16, 0, 32 * 32))
        assert fitted.shape(str(tmp_path / name)) == (3, 32, 16), name
        assert torch.equal(fitted([str(tmp_path / name)])[0], shown), name


@pytest.mark.parametrize("orientation", range(1, 9))
def test_images_of_every_exif_orientation_are_what_pillows_exif_transpose_shows(tmp_path, orientation) -> None:
    """Each of the eight EXIF orientations (mirrored ones, 2 4 5 7, as a front camera writes them;
    5 and 7 also stored on their side): the pixels are Pillow's `ImageOps.exif_transpose` of the
    file, and under items of their own size the header's shape is the shown image's (5 to 8:
    height and width swapped)."""
    import numpy as np
    from PIL import Image, ImageOps

    from dtensor_mimo.data.conversation import image_inputs

    stored = np.random.default_rng(orientation).integers(0, 256, (16, 32, 3), dtype=np.uint8)  # no symmetry
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = str(tmp_path / f"o{orientation}.png")
    Image.fromarray(stored).save(path, exif=exif)
    with Image.open(path) as image:
        shown = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    expected = torch.tensor(shown.copy()).permute(2, 0, 1).float()
    assert torch.equal(image_inputs(_Pixels())([path])[0], expected)
    fitted = image_inputs(_Pixels(), fit=(16, 0, 32 * 32))
    assert fitted.shape(path) == (3, *shown.shape[:2])
    assert torch.equal(fitted([path])[0], expected)


def test_transparent_images_are_what_transformers_processors_make_of_them(tmp_path) -> None:
    """An image with transparency (RGBA or grey + alpha PNG, RGBA WebP, a palette PNG with a
    transparent index: logos, screenshots, stickers) becomes the pixels transformers' own image
    processor makes of the file (``do_convert_rgb``: transparency composited onto white), with a
    SigLIP processor and a CLIP one (shortest edge + center crop), at the processor's size and
    at an image's own size (dynamic resolution). Pillow's RGB conversion drops the alpha band,
    baring whatever colour the transparent pixels store (black here): the pretrained tower saw
    black where its processor gives white."""
    import numpy as np
    import transformers
    from PIL import Image

    from dtensor_mimo.data.conversation import fit_image_size, image_inputs

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, (20, 28), dtype=np.uint8)
    alpha[:6] = 0  # fully transparent rows
    rgb[:6] = 0  # which store black, as most encoders write them
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(tmp_path / "rgba.webp", lossless=True)
    Image.fromarray(np.dstack([rgb[..., 0], alpha]), "LA").save(tmp_path / "la.png")
    Image.fromarray(rgb).quantize(16).save(tmp_path / "palette.png", transparency=0)
    processors = [transformers.SiglipImageProcessor(size={"height": 16, "width": 16}),
                  transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})]
    def over_white(image):  # transformers' `convert_to_rgb` (4.x, and 5.x's torchvision backend)
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")

    # The file given to the processor, where it composites itself (transformers 5.24); else the file
    # composited as above (5.17's PIL backend drops the alpha band, as Pillow's RGB conversion does).
    with Image.open(tmp_path / "rgba.png") as image:
        probe = processors[0](images=image, return_tensors="pt")["pixel_values"]
        itself = torch.equal(probe, processors[0](images=over_white(image), return_tensors="pt")["pixel_values"])
    for processor in processors:
        for name in ("rgba.png", "rgba.webp", "la.png", "palette.png"):
            path = str(tmp_path / name)
            with Image.open(path) as image:
                given = image if itself else over_white(image)
                want = processor(images=given, return_tensors="pt")["pixel_values"]
            torch.testing.assert_close(image_inputs(processor)([path]), want, rtol=0, atol=1e-6,
                                       msg=f"{type(processor).__name__} {name}")
            fit = (4, 16, 32 * 32)
            h, w = fit_image_size(20, 28, *fit)
            with Image.open(path) as image:
                given = image if itself else over_white(image)
                want = processor(images=given, size={"height": h, "width": w}, do_center_crop=False,
                                 return_tensors="pt")["pixel_values"][0]
            torch.testing.assert_close(image_inputs(processor, fit)([path])[0], want, rtol=0, atol=1e-6,
                                       msg=f"{type(processor).__name__} {name} at its own size")


def test_images_at_their_own_size_are_not_padded_to_a_square_first(tmp_path) -> None:
    """Dynamic resolution with a processor that pads each image to a square before resizing
    (transformers' LlavaImageProcessor, ``do_pad``: LLaVA's "pad to square"): a 16x48 image,
    whose own size (`fit_image_size`) is 16x48, was padded to 48x48 with the mean colour and
    then squeezed into 16x48: two thirds of its rows padding, its content a third as high, at the
    size the header predicted (nothing named it). Its pixels are the image's own: left third
    black, the rest grey 200, normalized by the processor's mean and std."""
    import numpy as np
    from PIL import Image
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from dtensor_mimo.data.conversation import fit_image_size, image_inputs

    stored = np.full((16, 48, 3), 200, dtype=np.uint8)
    stored[:, :16] = 0
    Image.fromarray(stored).save(tmp_path / "wide.png")
    processor = LlavaImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                       do_pad=True)
    fit = (4, 16, 64 * 64)
    assert fit_image_size(16, 48, *fit) == (16, 48)  # already its size: no resampling
    mean, std = (torch.tensor(v, dtype=torch.float64)[:, None, None] for v in (processor.image_mean,
                                                                                processor.image_std))
    want = (torch.tensor(stored, dtype=torch.float64).permute(2, 0, 1) / 255 - mean) / std
    got = image_inputs(processor, fit)([str(tmp_path / "wide.png")])[0]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    # the processor's own square input keeps its padding (transformers' LLaVA preprocessing)
    square = image_inputs(processor)([str(tmp_path / "wide.png")])
    with Image.open(tmp_path / "wide.png") as image:
        torch.testing.assert_close(square, processor(images=image, return_tensors="pt")["pixel_values"],
                                   rtol=0, atol=1e-6)


def test_a_dataset_directory_with_a_trailing_slash_finds_the_same_media(corpus) -> None:
    """data.path = 'data/hf/' (as a shell completes a directory) is 'data/hf': media paths are
    relative to the directory that holds it, not to the dataset directory itself."""
    from dtensor_mimo.data.sources import open_source

    data = os.path.join(corpus["dir"], "data")
    plain = open_source("hf", os.path.join(data, "part-0.parquet"), None)
    index = next(i for i in range(len(plain)) if plain[i]["image"])
    expected = [os.path.join(data, p) for p in plain[index]["image"]]
    assert plain.media(index, plain[index], "image") == expected
    datasets.Dataset.from_parquet(os.path.join(data, "part-0.parquet")).save_to_disk(os.path.join(data, "hf_paths"))
    for written in ("hf_paths", "hf_paths/", "hf_paths//"):
        source = open_source("hf", os.path.join(data, written), None)
        assert source.media(index, source[index], "image") == expected, written


def test_a_corrupt_parquet_row_group_names_the_file_and_row(tmp_path) -> None:
    """A Parquet file whose third row group is damaged (a bad disk, a copy cut and mended): its
    other rows read; a row of the damaged group raises DataError naming the file and the row,
    not pyarrow's bare OSError ("corrupt data page?"), which names neither among many files."""
    import pyarrow as pa

    from dtensor_mimo.data.conversation import DataError
    from dtensor_mimo.data.sources import open_source

    conv = [{"from": "human", "value": "hi " * 50}, {"from": "gpt", "value": "yo"}]
    good = str(tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"conversations": [conv] * 40, "id": [f"s{i}" for i in range(40)]}), good,
                   row_group_size=10)
    column = pq.ParquetFile(good).metadata.row_group(2).column(0)
    data = bytearray(open(good, "rb").read())
    data[column.data_page_offset + 40:column.data_page_offset + 240] = b"\xff" * 200
    bad = str(tmp_path / "part-1.parquet")
    open(bad, "wb").write(bytes(data))
    source = open_source("hf", str(tmp_path / "part-*.parquet"), None)
    assert len(source) == 80 and source[45]["id"] == "s5" and source[79]["id"] == "s39"
    with pytest.raises(DataError, match=r"part-1\.parquet.*row 25\b"):
        source[65]


def test_a_tar_sample_missing_its_member_is_broken_media(corpus, tmp_path, monkeypatch) -> None:
    """A sample past the checked head whose JSON names a member its shard lacks (a file missing
    from the corpus, as a failed download leaves it) is that sample's broken media, as a missing
    file of the llava format is: MediaError naming the sample and the member, on the row holding
    it, so that ``data.skip_bad_media`` leaves it out; the row left out builds, with its
    neighbour's tokens as without it."""
    from dtensor_mimo.data.conversation import MediaError
    from dtensor_mimo.train import datasets

    data = os.path.join(corpus["dir"], "data")
    samples = [json.loads(line) for line in open(os.path.join(data, "train.jsonl"))]
    imaged = [i for i, s in enumerate(samples) if len(_images(s)) == 1 and i >= 4]
    k = imaged[0]
    key = samples[k]["id"].replace("-", "_")
    whole = tmp_path / "whole.tar"
    _write_tar(str(whole), samples[:k + 2], data)
    cut = tmp_path / "data" / "cut.tar"
    cut.parent.mkdir()
    with tarfile.open(whole) as src, tarfile.open(cut, "w") as dst:
        for info in src.getmembers():
            if info.name != f"{key}.png":
                dst.addfile(info, src.extractfile(info))
    shutil.copytree(os.path.join(corpus["dir"], "ckpt"), tmp_path / "ckpt")
    monkeypatch.setattr(datasets, "CHECKED_SAMPLES", 2)  # the sample lies past the checked head
    train = _data(str(tmp_path), ["--data.format", "webdataset", "--data.path", "data/cut.tar", "--data.root", "none",
                                  "--data.batch_size", "2"]).train
    with pytest.raises(MediaError) as e:
        train.batch([k - 1, k])
    assert e.value.row == 1 and e.value.sample_id == samples[k]["id"] and e.value.path.endswith("cut.tar[png]")
    assert "no member of the sample" in str(e.value)
    left_out = train.batch([k - 1, k], left_out=(1,))
    alone = train.batch([k - 1])
    n = int((alone.tokens[0] != alone.tokens[0, -1]).sum())
    assert torch.equal(left_out.tokens[0, :n], alone.tokens[0, :n]) and int(left_out.loss_mask[1].sum()) == 0


def test_packing_starts_a_row_for_a_first_sample_without_tokens() -> None:
    """`ConversationDataset._pack`: a sample truncated to no tokens (an item at position 0 longer
    than seq_len, data.truncate) may come first in the drawn order; it opens the first row as any
    sample would (it raised IndexError), and the others fill rows up to pack_len."""
    from types import SimpleNamespace

    from dtensor_mimo.data.conversation import ConversationDataset

    lengths = [0, 5, 4, 3, 6]
    stub = SimpleNamespace(samples=lengths, pack_len=9, _length=lambda i: lengths[i])
    rows = ConversationDataset._pack(stub, seed=0)
    order = torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()
    expected, used = [], 0  # greedy by hand in the drawn order
    for i in order:
        if not expected or used + lengths[i] > 9:
            expected.append([])
            used = 0
        expected[-1].append(i)
        used += lengths[i]
    assert rows == expected and sorted(i for r in rows for i in r) == list(range(5))
    stub.samples, lengths[:] = [0], [0]
    assert ConversationDataset._pack(stub, seed=0) == [[0]]


def test_a_corpus_of_more_files_than_may_be_open_reads_through(tmp_path) -> None:
    """A corpus of more files than the process may hold open (its RLIMIT_NOFILE, 1024 by default
    on Linux; LLaVA-scale webdataset / Parquet corpora come in thousands of shards), read in a
    shuffled order as the sampler reads it: every sample and media member read is the one
    written. (Each JSONL, tar and Parquet file read stayed open for the life of the source: past
    the limit, OSError "Too many open files" naming no file, mid-epoch.)"""
    import random
    import resource

    import pyarrow as pa

    from dtensor_mimo.data.sources import open_source

    files = 150
    conv = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "yo"}]
    for k in range(files):
        sample = {"id": f"s{k}", "conversations": conv}
        (tmp_path / f"p-{k:03d}.jsonl").write_text(json.dumps(sample) + "\n")
        _tar(str(tmp_path / f"p-{k:03d}.tar"), tarfile.PAX_FORMAT,
             [(f"k{k}.json", json.dumps({**sample, "image": "png"}).encode()), (f"k{k}.png", f"png {k}".encode())])
        pq.write_table(pa.table({"id": [f"s{k}"], "conversations": [conv], "image": [f"png {k}".encode()]}),
                       str(tmp_path / f"p-{k:03d}.parquet"))
    order = list(range(files))
    random.Random(0).shuffle(order)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    sources = [open_source(format_, str(tmp_path / f"p-*.{ext}"), None)
               for format_, ext in (("llava", "jsonl"), ("webdataset", "tar"), ("hf", "parquet"))]
    try:
        for source in sources:  # room for 100 more open files than are open now
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
            assert len(source) == files
            for i in order:
                sample = source[i]
                assert sample["id"] == f"s{i}", source.format
                if source.format != "llava":
                    [ref] = source.media(i, sample, "image")
                    assert source.open(ref).read() == f"png {i}".encode(), source.format
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_parquet_files_read_keep_a_bounded_number_of_row_groups(tmp_path) -> None:
    """A Parquet source keeps a decoded row group for the rows read next to it (a sample's media
    are read right after its row), not one for every file of the corpus it has read from: Arrow
    memory held after reading a row of each of 400 files of one 128 KiB row group stays under
    half of the 50 MiB all their groups take (it held them all: memory that grows with the
    corpus, in every rank and loader worker)."""
    import pyarrow as pa

    from dtensor_mimo.data.sources import open_source

    files, size = 400, 128 << 10
    conv = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "yo"}]
    for k in range(files):
        pq.write_table(pa.table({"conversations": [conv], "image": [os.urandom(size)]}),
                       str(tmp_path / f"p-{k:03d}.parquet"))
    source = open_source("hf", str(tmp_path / "p-*.parquet"), None)
    assert len(source) == files
    before = pa.total_allocated_bytes()
    for i in range(files):
        [ref] = source.media(i, source[i], "image")
        assert len(source.open(ref).read()) == size
    assert pa.total_allocated_bytes() - before < files * size / 2
