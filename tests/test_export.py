"""Export to Hugging Face, checked against `transformers` itself: every directory written here is
loaded by transformers (no missing or unexpected tensors) and its outputs are compared with the
library's single-process modules (fp32: within 1e-5). Modules are tiny (dim 32, 2 layers, 16x16
images in 4x4 patches) with every weight, bias and norm perturbed, so a misplaced tensor shows.

| test                                        | what                                                         |
|---------------------------------------------|--------------------------------------------------------------|
| test_llava_matches_transformers[siglip-66]  | SigLIP-style ViT (no final norm) + Projection + Qwen2-style Llama -> `save_llava_hf`; the image token 66 lies outside the 64-token vocabulary (embedding and head extended, ids 64-66 suppressed); `AutoProcessor` -> LlavaProcessor expands `<image>` to the ViT's 16 tokens; logits of a prompt with an image; greedy `generate` equals a greedy loop over our modules; `load_hf` reads the directory back |
| test_llava_matches_transformers[clip-62]    | CLIP-style ViT (class token dropped: strategy "default"), image token 62 inside the vocabulary |
| test_whisper_encoder_matches_transformers   | `AudioEncoder` (with a key bias, which softmax ignores) -> `WhisperEncoder.from_pretrained`: features |
| test_projection_matches_transformers        | `Projection` -> LLaVA's projector names + config.json; transformers' LlavaMultiModalProjector gives its outputs |
| test_pipeline_stages_and_bf16               | two pipeline stages of a Llama (and of a ViT), saved one by one (`layer_split`), make one directory; bf16 export equals the bf16 cast |
| test_writing_over_an_earlier_export_...     | rewritten (sharded <-> one file): both readers get the new weights |
| test_refusals_are_named                     | a ViT with a final norm in LLaVA, a projector LLaVA cannot express, a tokenizer without the image token, an image processor of another size, Whisper strides, a stage without its split |
| test_an_image_processor_that_keeps_...      | CLIP shortest_edge without crop / no resize: refused by name |
| test_export_hf[colocated_tp_fsdp]           | `export_hf` of a MimoModel, 4 ranks: vision dp4 (FSDP2) and language dp2·tp2 (FSDP2) on the same ranks -> one LLaVA directory |
| test_export_hf[disjoint_pp2]                | vision dp2 (FSDP2, frozen tower, ranks 0-1), language pp2 (ranks 2-3, one file per stage) -> one LLaVA directory |
| test_export_hf[per_module]                  | vision + audio (dp2, colocated, 0-1; FSDP2 with uneven shards), language tp2 (2-3): SigLIP, Whisper, Qwen2 directories, projectors, tokenizer and processors; `save_hf` of the tp2 module itself writes the same bytes; `llava=True` and a wrong modality refused on every rank |
| test_a_feature_extractor_of_other_clips... | a Whisper feature extractor of 3000 frames beside a 32-frame encoder: refused by name on every rank; one of 32 frames feeds the exported WhisperEncoder |
| test_export_hf_gathers_each_tensor_... | 4 ranks: a rank that does not write makes no tensor over its shards |
| test_export_after_a_forward_without_...    | 2 ranks, vision + language dp2 (FSDP2, bf16 compute) colocated: a forward with gradients on and no backward leaves the FSDP2 roots gathered (bf16 copies); `export_hf` (own dtype, and dtype=fp32) still writes the single-process fp32 tensors exactly |
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, MimoModel, Parallelism, PipelineConfig
from dtensor_mimo.assemble import assemble, embed_text
from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    ModalityEncoder,
    Projection,
    ViT,
    ViTConfig,
    load_hf,
    save_hf,
    save_llava_hf,
)
from dtensor_mimo.models.protocol import decoder_stage
from dtensor_mimo.schedule.encoders import keep_encoder_stage
from tests.harness import run_on_ranks

transformers = pytest.importorskip("transformers")

# From its module: transformers 5.17 without torchvision makes the top-level name a placeholder that raises.
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # noqa: E402
safetensors_torch = pytest.importorskip("safetensors.torch")
PIL = pytest.importorskip("PIL.Image")

LLAMA = LlamaConfig.tiny(qkv_bias=True)  # Qwen2-style: vocab 64, dim 32, 2 layers, GQA 4/2
SIGLIP = ViTConfig.tiny(activation="gelu_tanh", final_norm=False)  # 16x16 images, 4x4 patches
CLIP = ViTConfig.tiny(activation="quick_gelu", class_token=True, pre_norm=True, patch_bias=False, final_norm=False)
AUDIO = AudioConfig.tiny()  # 8 mel bins, 32 frames -> 16 tokens; a key bias
TOWERS = {"siglip": SIGLIP, "clip": CLIP}
TEXT = "t1 t2 <image> t3 t4"


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`module` initialized from `seed`, then every tensor moved (biases and norms included)."""
    module.init_weights(seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return module


def _llava_modules(tower: str = "siglip") -> tuple[ViT, Projection, Llama]:
    return (_perturbed(ViT(TOWERS[tower]), 1), _perturbed(Projection(32, 32), 2), _perturbed(Llama(LLAMA), 3))


def _tokenizer(image_token_id: int, eos: str | None = None):
    """A word-level tokenizer: t0..t59 are ids 0..59, <unk> 60, <image> `image_token_id`; `eos`
    its end-of-sequence word, if any."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(60)} | {"<unk>": 60, "<image>": image_token_id}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token=eos,
                                                additional_special_tokens=["<image>"])
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def _image_processor(tower: str):
    if tower == "clip":
        return transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return transformers.SiglipImageProcessor(size={"height": 16, "width": 16})


def _feature_extractor(**overrides):
    """A Whisper feature extractor of AUDIO's clips: 8 mel bins, 32 frames (1 s at 3.2 kHz, hop 100)."""
    fields = dict(feature_size=AUDIO.n_mels, sampling_rate=3200, hop_length=100, chunk_length=1)
    return transformers.WhisperFeatureExtractor(**(fields | overrides))


def _whisper_encoder() -> type:
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    return WhisperEncoder


def _image() -> "PIL.Image.Image":
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return PIL.fromarray(pixels)


@torch.no_grad()
def _our_logits(vit: ViT, projection: Projection, llama: Llama, tokens: torch.Tensor, pixels: torch.Tensor,
                image_token_id: int) -> torch.Tensor:
    """The library's single-process model, as `examples/train_digits.py` assembles it."""
    ids = {"vision": image_token_id}
    rows = ModalityEncoder(vit, projection)(pixels)
    return llama(h=assemble(embed_text(llama.tok_embeddings, tokens, ids), tokens, {"vision": rows}, ids))


@torch.no_grad()
def _our_greedy(modules, tokens: torch.Tensor, pixels: torch.Tensor, image_token_id: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        next_id = int(_our_logits(*modules, tokens, pixels, image_token_id)[0, -1].argmax())
        out.append(next_id)
        tokens = torch.cat([tokens, torch.tensor([[next_id]])], dim=1)
    return out


def _load_llava(path: str):
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _check_llava(path: str, modules, tower: str, image_token_id: int, generate: bool = True) -> None:
    """The LLaVA directory at `path` against the library's `modules`, through transformers."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "LlavaProcessor"
    inputs = processor(text=TEXT, images=[_image()], return_tensors="pt")
    tokens, pixels = inputs["input_ids"], inputs["pixel_values"]
    assert int((tokens == image_token_id).sum()) == TOWERS[tower].num_patches  # the ViT's tokens per image
    hf = _load_llava(path)
    assert hf.config.image_token_id == image_token_id
    want = _our_logits(*modules, tokens, pixels, image_token_id)
    with torch.no_grad():
        got = hf(**inputs).logits
    torch.testing.assert_close(got[..., :LLAMA.vocab_size], want, rtol=0, atol=1e-5)
    added = list(range(LLAMA.vocab_size, max(LLAMA.vocab_size, image_token_id + 1)))
    assert got.shape[-1] == LLAMA.vocab_size + len(added)
    assert list(hf.generation_config.suppress_tokens or []) == added
    if generate:
        with torch.no_grad():
            generated = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, tokens.shape[1]:].tolist()
        assert generated == _our_greedy(modules, tokens, pixels, image_token_id, 6)


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("tower, image_token_id", [("siglip", 66), ("clip", 62)])
def test_llava_matches_transformers(tower: str, image_token_id: int, tmp_path) -> None:
    modules = _llava_modules(tower)
    save_llava_hf(*modules, str(tmp_path), image_token_id=image_token_id, tokenizer=_tokenizer(image_token_id),
                  image_processor=_image_processor(tower))
    _check_llava(str(tmp_path), modules, tower, image_token_id)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vision_feature_select_strategy"] == ("full" if tower == "siglip" else "default")
    # The library reads its export back: the same tower, projector, and decoder (vocabulary extended).
    vit = ViT(ViTConfig.from_hf(str(tmp_path)))
    assert vit.config == TOWERS[tower]
    llama = Llama(LlamaConfig.from_hf(str(tmp_path)))
    assert llama.config.vocab_size == max(64, image_token_id + 1)
    for module, original in zip((vit, Projection(32, 32), llama), modules):
        load_hf(module, str(tmp_path))
        for (name, value), want in zip(module.named_parameters(), original.parameters()):
            assert torch.equal(value[:want.shape[0]], want), name


def test_whisper_encoder_matches_transformers(tmp_path) -> None:
    encoder = _perturbed(AudioEncoder(AUDIO), 4)
    assert encoder.layers["0"].attn.wk.bias is not None
    save_hf(encoder, str(tmp_path))
    hf, info = _whisper_encoder().from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    mels = torch.randn(2, AUDIO.n_mels, AUDIO.max_frames, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(mels).last_hidden_state, encoder(mels), rtol=0, atol=1e-5)


def test_projection_matches_transformers(tmp_path) -> None:
    projection = _perturbed(Projection(24, 32), 6)
    save_hf(projection, str(tmp_path))
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == [f"multi_modal_projector.linear_{i}.{k}" for i in (1, 2) for k in ("bias", "weight")]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["in_features"], config["hidden_features"], config["out_features"]) == (24, 32, 32)
    assert config["projector_hidden_act"] == "gelu" and config["multimodal_projector_bias"] is True
    llava = transformers.LlavaConfig(
        vision_config=transformers.SiglipVisionConfig(hidden_size=24, num_attention_heads=4),
        text_config=transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
        projector_hidden_act=config["projector_hidden_act"])
    hf = transformers.models.llava.modeling_llava.LlavaMultiModalProjector(llava)
    hf.load_state_dict({k.removeprefix("multi_modal_projector."): v for k, v in tensors.items()})
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(hf(x), projection(x), rtol=0, atol=1e-6)


def test_pipeline_stages_and_bf16(tmp_path) -> None:
    """Each stage (its own parameters only, under the whole model's names) writes its own file;
    the first writes config.json and the index: one directory, the whole model's logits."""
    llama = _perturbed(Llama(LLAMA), 8)
    for stage, layers in enumerate(([0], [1])):
        part = decoder_stage(llama, layers, first=stage == 0, last=stage == 1)
        save_hf(part, str(tmp_path / "staged"), layer_split=[1, 1])
    index = json.loads((tmp_path / "staged" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.mlp.up_proj.weight"] != index["model.layers.1.mlp.up_proj.weight"]
    assert index["model.embed_tokens.weight"] == index["model.layers.0.mlp.up_proj.weight"]
    assert index["lm_head.weight"] == index["model.layers.1.mlp.up_proj.weight"]
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(9))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "staged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, llama(tokens), rtol=0, atol=1e-5)
    vit = _perturbed(ViT(ViTConfig.tiny()), 9)  # an encoder's stages, cut as encoder pipelines cut them
    for stage in (0, 1):
        part = copy.deepcopy(ModalityEncoder(vit, Projection(32, 32)))
        keep_encoder_stage(part, range(stage, stage + 1), first=stage == 0, last=stage == 1)
        save_hf(part.encoder, str(tmp_path / "vit"), layer_split=[1, 1])
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(10))
    siglip = transformers.SiglipVisionModel.from_pretrained(str(tmp_path / "vit")).eval()
    with torch.no_grad():
        torch.testing.assert_close(siglip(pixel_values=images).last_hidden_state, vit(images), rtol=0, atol=1e-5)
    save_hf(llama, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert bf16.config.dtype == torch.bfloat16
    fp32 = hf.state_dict()
    for name, value in bf16.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, fp32[name].to(torch.bfloat16)), name


def test_refusals_are_named(tmp_path) -> None:
    vit, projection, llama = _llava_modules()
    with pytest.raises(ValueError, match=r"final norm \(final_norm=True\).*final_norm=False"):
        save_llava_hf(ViT(ViTConfig.tiny()), projection, llama, str(tmp_path / "a"), image_token_id=66)
    with pytest.raises(ValueError, match=r"the Projection is 32 -> 64 -> 32; build it as Projection\(32, 32\)"):
        save_llava_hf(vit, Projection(32, 32, hidden_dim=64), llama, str(tmp_path / "b"), image_token_id=66)
    with pytest.raises(ValueError, match="the tokenizer has no token with the image token id 65"):
        save_llava_hf(vit, projection, llama, str(tmp_path / "c"), image_token_id=65, tokenizer=_tokenizer(66))
    with pytest.raises(ValueError, match=r"conv_strides=\(2, 2\)"):
        save_hf(AudioEncoder(AudioConfig.tiny(conv_strides=(2, 2))), str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"makes \{'height': 224, 'width': 224\} images but the ViT takes 16x16"):
        save_llava_hf(vit, projection, llama, str(tmp_path / "f"), image_token_id=66,
                      image_processor=transformers.SiglipImageProcessor())
    with pytest.raises(ValueError, match="pass layer_split"):
        save_hf(decoder_stage(llama, [0], first=True, last=False), str(tmp_path / "e"))
    assert not any((tmp_path / d).exists() for d in "abcdef")  # refused before anything was written


@pytest.mark.parametrize("fields", [dict(size={"shortest_edge": 16}, do_center_crop=False),
                                    dict(size={"shortest_edge": 32}, do_center_crop=False),
                                    dict(size={"height": 16, "width": 16}, do_resize=False, do_center_crop=False)],
                         ids=["shortest_edge", "shortest_edge_32", "no_resize"])
def test_an_image_processor_that_keeps_each_images_shape_is_refused(fields, tmp_path) -> None:
    """A CLIP processor resizing the shortest edge without a center crop (or not resizing at all)
    makes each image its own shape: a 16x40 image becomes 16x40 (32x80) pixels, and the exported
    LlavaProcessor expands its <image> to 40 (160) placeholders for a 16x16 tower of 16 patches.
    `processor_problem` read only height / width sizes, found none, and passed it: the export
    was written (and a run that exports passed the launcher's checks). Refused by name, before
    anything is written; a crop to the tower's size passes."""
    from dtensor_mimo.models.hf.export import module_spec, processor_problem

    processor = transformers.CLIPImageProcessor(**fields)
    wide = PIL.fromarray(np.zeros((16, 40, 3), dtype=np.uint8))
    made = processor(images=wide, return_tensors="pt")["pixel_values"].shape[-2:]
    assert tuple(made) != (16, 16)  # what the exported processor would give the 16x16 tower
    modules = _llava_modules("clip")
    with pytest.raises(ValueError, match=r"save_llava_hf: the image processor .*does not center crop: each "
                                         r"image.*16x16.*"
                                         r"\{'height': 16, 'width': 16\}"):
        save_llava_hf(*modules, str(tmp_path / "out"), image_token_id=62, tokenizer=_tokenizer(62),
                      image_processor=processor)
    assert not (tmp_path / "out").exists()
    cropped = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    assert tuple(cropped(images=wide, return_tensors="pt")["pixel_values"].shape[-2:]) == (16, 16)
    assert processor_problem(cropped, module_spec(modules[0])) is None


@pytest.mark.parametrize("first_shard_bytes, second_shard_bytes", [(4096, None), (None, 4096)])
def test_writing_over_an_earlier_export_leaves_no_stale_weights(first_shard_bytes, second_shard_bytes,
                                                                tmp_path) -> None:
    """A directory written again (more training, another dtype or shard size) holds the new
    weights only: from sharded to one file, the earlier index and shards would be read by
    `load_hf` (it reads an index first); from one file to sharded, the earlier
    ``model.safetensors`` by transformers (it reads that first). Both read the new model."""
    path = str(tmp_path / "out")
    old, new = _perturbed(Llama(LLAMA), 11), _perturbed(Llama(LLAMA), 12)
    for module, shard in ((old, first_shard_bytes), (new, second_shard_bytes)):
        save_hf(module, path, **({} if shard is None else dict(max_shard_bytes=shard)))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(13))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    again = Llama(LlamaConfig.from_hf(path))
    load_hf(again, path)
    with torch.no_grad():
        want = new(tokens)
        torch.testing.assert_close(hf(tokens).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(again(tokens), want, rtol=0, atol=0)
    files = sorted(f for f in os.listdir(path) if f.startswith("model"))
    if second_shard_bytes is None:
        assert files == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
        assert files == sorted({*index.values(), "model.safetensors.index.json"})

# ------------------------------------------------------------------ export_hf on 4 ranks

P = Parallelism
CASES = {
    "colocated_tp_fsdp": (dict(vision=P(dp=4), language=P(dp=2, tp=2)), dict(vision=0, language=0), None),
    "disjoint_pp2": (dict(vision=P(dp=2), language=P(pp=2)), None, PipelineConfig(microbatches=2)),
    "per_module": (dict(vision=P(dp=2), audio=P(dp=2), language=P(tp=2)), dict(vision=0, audio=0, language=2),
                   None),
}
IMAGE_ID, AUDIO_ID = 66, 67


def _mimo_modules(case: str) -> tuple[Llama, dict[str, ModalityEncoder]]:
    if case != "per_module":
        vit, projection, llama = _llava_modules()
        if case == "disjoint_pp2":
            vit.requires_grad_(False)  # a frozen tower exports too
        return llama, {"vision": ModalityEncoder(vit, projection)}
    encoders = {"vision": ModalityEncoder(_perturbed(ViT(ViTConfig.tiny()), 1), _perturbed(Projection(32, 32), 2)),
                "audio": ModalityEncoder(_perturbed(AudioEncoder(AUDIO), 4), _perturbed(Projection(32, 32, 49), 5))}
    return _perturbed(Llama(LLAMA), 3), encoders


def _export(case: str, path: str) -> None:
    modules, offsets, pipeline = CASES[case]
    layout = MimoLayout(modules, offsets=offsets)
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules(case)
    model = MimoModel(layout, llama, encoders, pipeline=pipeline)
    if case == "per_module":
        processors = {"vision": transformers.SiglipImageProcessor(size={"height": 16, "width": 16}),
                      "audio": _feature_extractor()}
        export = dict(modalities={"vision": "image", "audio": "audio"},
                      special_token_ids={"vision": IMAGE_ID, "audio": AUDIO_ID}, processors=processors)
    else:
        export = dict(modalities={"vision": "image"}, special_token_ids={"vision": IMAGE_ID},
                      processors={"vision": _image_processor("siglip")})
    from dtensor_mimo.train.export import export_hf

    export_hf(model, path, tokenizer=_tokenizer(IMAGE_ID, eos="t2" if case == "per_module" else None), **export)
    # The directory is complete on every rank when export_hf returns.
    assert os.path.exists(os.path.join(path, "language" if case == "per_module" else "", "config.json"))
    refusals = []  # every rank refuses, before anything is written
    if case == "per_module":
        if model.language is not None:  # save_hf itself on the tp2 ranks: a collective, tp rank 0 writes
            save_hf(model.language.llama, path + "-direct")
        for wrong in (dict(export, llava=True), dict(export, modalities={"vision": "audio", "audio": "audio"})):
            with pytest.raises(ValueError) as error:
                export_hf(model, path + "-refused", **wrong)
            refusals.append(str(error.value))
        assert not os.path.exists(path + "-refused")
    dist.barrier()
    return refusals


@pytest.mark.parametrize("case", list(CASES))
def test_export_hf(case: str, tmp_path) -> None:
    refusals = run_on_ranks(_export, 4, case, str(tmp_path), timeout=120)
    if case == "per_module":
        for llava, modality in refusals:
            assert "export_hf(llava=True): the model is not LLaVA-shaped: it has 2 encoders" in llava
            assert "modalities 'vision' is 'audio' but its tower is a ViT" in modality
    llama, encoders = _mimo_modules(case)
    if case != "per_module":
        vision = encoders["vision"]
        _check_llava(str(tmp_path), (vision.encoder, vision.projection, llama), "siglip", IMAGE_ID, generate=False)
        if case == "disjoint_pp2":  # each language stage wrote its own file
            index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
            files = {index[f"language_model.model.layers.{i}.mlp.up_proj.weight"] for i in (0, 1)}
            assert len(files) == 2 and len(set(index.values())) == 4  # tower, projector, 2 stages
        return
    direct = (tmp_path.parent / (tmp_path.name + "-direct") / "model.safetensors").read_bytes()
    assert direct == (tmp_path / "language" / "model.safetensors").read_bytes()
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(9))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "language")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, llama(tokens), rtol=0, atol=1e-5)
    assert hf.generation_config.eos_token_id == 2  # the tokenizer's: transformers' generate stops there
    # (AutoTokenizer would pick Qwen2's own tokenizer class for this toy word-level vocabulary)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "language"))
    assert tokenizer("t3 t5 <image>").input_ids == [3, 5, IMAGE_ID] and tokenizer.chat_template
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(10))
    siglip = transformers.SiglipVisionModel.from_pretrained(str(tmp_path / "vision")).eval()
    mels = torch.randn(2, AUDIO.n_mels, AUDIO.max_frames, generator=torch.Generator().manual_seed(11))
    whisper = _whisper_encoder().from_pretrained(str(tmp_path / "audio")).eval()
    with torch.no_grad():
        torch.testing.assert_close(siglip(pixel_values=images).last_hidden_state, encoders["vision"].encoder(images),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(whisper(mels).last_hidden_state, encoders["audio"].encoder(mels), rtol=0, atol=1e-5)
    for name, token_id in (("vision", IMAGE_ID), ("audio", AUDIO_ID)):
        projector = tmp_path / name / "projector"
        config = json.loads((projector / "config.json").read_text())
        assert config["special_token_id"] == token_id
        assert config["modality"] == ("image" if name == "vision" else "audio")
        tensors = safetensors_torch.load_file(str(projector / "model.safetensors"))
        assert torch.equal(tensors["multi_modal_projector.linear_2.weight"], encoders[name].projection.fc2.weight)
    assert type(AutoImageProcessor.from_pretrained(str(tmp_path / "vision"))).__name__.startswith("Siglip")
    assert transformers.AutoFeatureExtractor.from_pretrained(str(tmp_path / "audio")).feature_size == AUDIO.n_mels


def _export_audio(path: str, extractor) -> str:
    """vision, audio and language dp2 on the same two ranks, exported with the audio `extractor`."""
    from dtensor_mimo.train.export import export_hf

    layout = MimoLayout(dict(vision=P(dp=2), audio=P(dp=2), language=P(dp=2)),
                        offsets=dict(vision=0, audio=0, language=0))
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules("per_module")
    model = MimoModel(layout, llama, encoders)
    try:
        export_hf(model, path, modalities={"vision": "image", "audio": "audio"},
                  special_token_ids={"vision": IMAGE_ID, "audio": AUDIO_ID}, processors={"audio": extractor})
    except ValueError as error:
        return str(error)
    return "exported"


def test_a_feature_extractor_of_other_clips_than_the_encoder_is_refused(tmp_path) -> None:
    """The exported WhisperEncoder takes clips of exactly the AudioEncoder's 32 frames: a feature
    extractor of Whisper's 30 s clips (3000 frames) beside it could not feed it (transformers
    raises on its features), so it is refused by name on every rank, before anything is written;
    one of 32 frames is written and feeds the encoder its features."""
    whisper_30s = transformers.WhisperFeatureExtractor(feature_size=AUDIO.n_mels)
    errors = run_on_ranks(_export_audio, 2, str(tmp_path / "refused"), whisper_30s, timeout=120)
    for error in errors:
        assert ("processors 'audio': the feature extractor makes clips of 3000 frames but the AudioEncoder's "
                "Whisper encoder takes 32") in error, error
    assert not (tmp_path / "refused").exists()
    assert run_on_ranks(_export_audio, 2, str(tmp_path / "out"), _feature_extractor(), timeout=120) == ["exported"] * 2
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(tmp_path / "out" / "audio"))
    clip = np.random.default_rng(0).standard_normal(1600).astype(np.float32)  # half a second: padded to 1 s
    mels = extractor(clip, sampling_rate=3200, return_tensors="pt").input_features
    whisper = _whisper_encoder().from_pretrained(str(tmp_path / "out" / "audio")).eval()
    _, encoders = _mimo_modules("per_module")
    with torch.no_grad():
        torch.testing.assert_close(whisper(mels).last_hidden_state, encoders["audio"].encoder(mels), rtol=0, atol=1e-5)


def _export_with_a_failing_disk(path: str) -> str:
    """Language tp2 (two writers' gathers): rank 2's first write fails as on a full disk."""
    from dtensor_mimo.models.hf import safetensors as files
    from dtensor_mimo.train.export import export_hf

    modules, offsets, pipeline = CASES["per_module"]
    layout = MimoLayout(modules, offsets=offsets)
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules("per_module")
    model = MimoModel(layout, llama, encoders, pipeline=pipeline)
    if dist.get_rank() == 2:
        def full(self, tensor):
            raise OSError(28, "No space left on device")

        files.SafetensorsWriter.write = full
    try:
        export_hf(model, path, modalities={"vision": "image", "audio": "audio"},
                  special_token_ids={"vision": IMAGE_ID, "audio": AUDIO_ID}, tokenizer=_tokenizer(IMAGE_ID),
                  processors={})
    except (OSError, RuntimeError) as error:
        return str(error)
    return "exported"


def test_a_failing_write_fails_every_rank_without_a_hang(tmp_path) -> None:
    errors = run_on_ranks(_export_with_a_failing_disk, 4, str(tmp_path), timeout=120)
    assert "No space left on device" in errors[2]
    assert all("failed writing" in e for i, e in enumerate(errors) if i != 2), errors


def _export_after_a_forward_without_backward(path: str) -> None:
    """vision dp2 and language dp2 on the same two ranks, FSDP2 computing in bf16: a forward that
    keeps its graph and never runs backward (an evaluation loss with gradients on) leaves the FSDP2
    roots gathered, their parameters the bf16 copies; then export_hf, in the parameters' dtype and
    in fp32, and a checkpoint."""
    import dataclasses

    from dtensor_mimo import ParallelOptions
    from dtensor_mimo.data import SyntheticSpec, synthetic_batch
    from dtensor_mimo.train.export import export_hf

    layout = MimoLayout(dict(vision=P(dp=2), language=P(dp=2)), offsets=dict(vision=0, language=0))
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules("colocated_tp_fsdp")
    bf16 = ParallelOptions(param_dtype="bfloat16")
    model = MimoModel(layout, llama, encoders, options={"vision": bf16, "language": bf16})
    spec = SyntheticSpec.tiny()
    spec = dataclasses.replace(spec, modalities={"vision": spec.modalities["vision"]}, batch_size=4, seq_len=32)
    model(synthetic_batch(spec, 0))  # no backward
    export = dict(modalities={"vision": "image"}, special_token_ids={"vision": IMAGE_ID})
    export_hf(model, os.path.join(path, "own"), **export)
    export_hf(model, os.path.join(path, "fp32"), dtype=torch.float32, **export)
    from dtensor_mimo import MimoOptimizer
    from dtensor_mimo.train import checkpoint

    model(synthetic_batch(spec, 0))  # gathered again
    checkpoint.save(os.path.join(path, "ckpt"), 1, model, MimoOptimizer(model), {"step": 1}, keep=1)


def test_export_after_a_forward_without_backward_writes_the_fp32_weights(tmp_path) -> None:
    """The directory holds the fp32 weights, exactly those of the single-process modules; so does
    the checkpoint saved after another such forward (its shards, not the gathered bf16 copies)."""
    run_on_ranks(_export_after_a_forward_without_backward, 2, str(tmp_path), timeout=120)
    llama, encoders = _mimo_modules("colocated_tp_fsdp")
    vision = encoders["vision"]
    save_llava_hf(vision.encoder, vision.projection, llama, str(tmp_path / "reference"), image_token_id=IMAGE_ID)

    def tensors(directory: str) -> dict[str, torch.Tensor]:  # a file per part (tower, projector, language)
        files = sorted((tmp_path / directory).glob("*.safetensors"))
        return {k: v for f in files for k, v in safetensors_torch.load_file(str(f)).items()}

    want = tensors("reference")
    for directory in ("own", "fp32"):
        got = tensors(directory)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], value), (directory, name)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "ckpt" / "step-000001"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    modules = {"language": llama, "vision": vision}
    for module, m in modules.items():
        for name, value in m.named_parameters():
            got = saved[f"model.{module}.{name}"]
            assert got.dtype == torch.float32 and torch.equal(got, value.detach()), (module, name)


def _largest_tensor_during_export(path: str, language: str) -> tuple[bool, int, int]:
    """vision dp4 (FSDP2) and language dp2·tp2 (FSDP2 over tp: strided shards; the same with FP8
    weights, which FSDP2 all-gathers in float8: a tensor subclass; or tp DTensors and dp replicas
    without FSDP2) on the same four ranks, exported as one LLaVA directory: (whether this rank writes, the most elements
    of its parameters' local shards, the most elements of any floating-point tensor it made during the
    export)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from dtensor_mimo import ParallelOptions
    from dtensor_mimo.train.export import export_hf

    layout = MimoLayout(dict(vision=P(dp=4), language=P(dp=2, tp=2)), offsets=dict(vision=0, language=0))
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules("colocated_tp_fsdp")
    model = MimoModel(layout, llama, encoders, options={"language": ParallelOptions(**LANGUAGE_OPTIONS[language])})
    shards = [p.to_local() if isinstance(p, DTensor) else p for m in (model.language, model.encoders["vision"])
              for p in m.parameters()]
    largest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                # not all_gather_object's bytes, nor the meta modules that describe a module's names
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                    largest[0] = max(largest[0], (t.to_local() if isinstance(t, DTensor) else t).numel())
            return out

    with Largest():
        export_hf(model, path, modalities={"vision": "image"}, special_token_ids={"vision": IMAGE_ID})
    return dist.get_rank() == 0, max(s.numel() for s in shards), largest[0]


LANGUAGE_OPTIONS = {"fsdp": {}, "fp8": dict(fp8="tensorwise"), "replicas": dict(fsdp=False)}


@pytest.mark.parametrize("language", list(LANGUAGE_OPTIONS))
def test_export_hf_gathers_each_tensor_to_its_writer_only(language: str, tmp_path) -> None:
    """Only the writer of a module holds a whole tensor: the other ranks of a tp / FSDP2 module
    send it their shards and never make a tensor larger than the largest shard they hold (a
    whole embedding on every rank of a cluster would not fit), dp replicas of a module without
    FSDP2 send nothing; the directory holds exactly the single-process tensors."""
    results = run_on_ranks(_largest_tensor_during_export, 4, str(tmp_path / "out"), language, timeout=120)
    whole = LLAMA.vocab_size * LLAMA.dim  # the embedding (and head): the largest parameter
    for rank, (writer, shard, made) in enumerate(results):
        if writer:
            assert made >= whole, (rank, made)
        else:
            assert shard < whole and made <= shard, f"rank {rank} made a tensor of {made} elements, holds {shard}"
    llama, encoders = _mimo_modules("colocated_tp_fsdp")
    vision = encoders["vision"]
    save_llava_hf(vision.encoder, vision.projection, llama, str(tmp_path / "reference"), image_token_id=IMAGE_ID)
    for file in sorted(os.listdir(tmp_path / "reference")):
        if file.endswith(".safetensors") or file.endswith(".json") and file.startswith("model"):
            assert (tmp_path / "out" / file).read_bytes() == (tmp_path / "reference" / file).read_bytes(), file
