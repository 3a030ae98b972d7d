"""Hugging Face checkpoints in and out, against `transformers` itself (tiny random models that
each test writes with ``save_pretrained``; no download; skipped without transformers).

| test                                   | what                                                          |
|----------------------------------------|---------------------------------------------------------------|
| test_llama_family_matches_transformers | Llama 3.1 (llama3 rope scaling, tied embeddings), Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 16 != dim / heads), Mistral with head_dim 16 and 6 heads over dim 32 (no Llama config can hold it): logits within 1e-5 after `load_hf`, 128 tokens beyond the 64 of the original context; `save_hf` -> transformers -> the same logits |
| test_rope_fields_left_to_...           | llama3 rope without its original context, rope_theta out of rope_parameters |
| test_sharded_checkpoint_and_bf16       | `save_hf` in several files with an index; bf16 weights read back exactly |
| test_refused_configs_are_named         | what the model cannot express                                 |
| test_load_hf_names_a_config_mismatch   | a module built from another config                            |
| test_a_directory_transformers_rewrote_... | a stale index beside model.safetensors: that file, as transformers |
| test_siglip_tower_matches_transformers | SigLIP tower (tanh GELU, 30 px images in 4 px patches): features within 1e-5, `save_hf` round trip |
| test_clip_tower_matches_transformers   | CLIP tower (class token, pre-norm, quick GELU, no patch bias) |
| test_llava_checkpoint_fills_...        | one LLaVA directory: tower at vision_feature_layer -2, projector, Llama; image features and logits |
| test_whisper_encoder_matches_transformers | Whisper's encoder (no k_proj bias, frozen positions)       |
| test_llava_from_pretrained_example_learns | the example on 3 ranks: SigLIP tower (frozen) + Qwen2 on tp2 |
| test_llava_variants_the_modules_...   | a ReLU projector, a SigLIP tower whose first patch LLaVA drops |
| test_mimo_load_hf_refuses_on_every_rank | a mismatched checkpoint: every rank raises, none reads       |
| test_fields_left_at_transformers_defaults_read_as_those | a LLaVA directory whose nested configs leave out what equals transformers' defaults (as v4 wrote them: llava-1.5, siglip-so400m): features and logits as transformers reads them |
| test_clip_tower_without_layer_norm_eps_takes_clips_default | CLIP's 1e-5, not SigLIP's 1e-6 |
| test_a_sliding_window_left_at_mistrals_default_is_refused | Mistral's default 4096-token window, refused by name |
| test_default_table_is_transformers_own | `config_json.DEFAULTS` against transformers' config classes |
| test_llava_kin_take_their_feature_layer | LLaVA-NeXT / -OneVision towers: up to their vision_feature_layer |
| test_an_anyres_llava_directory_is_refused_... | LLaVA-NeXT / -OneVision: the tower loads; projector, encoder refused |
| test_an_anyres_directory_is_known_by_... | image_grid_pinpoints under type 'llava'; llava_next_video by its type |
| test_quantized_checkpoints_are_refused_... | FP8 / int8 weights: named while checking, nothing read |
| test_mimo_load_hf_refuses_a_quantized_... | an FP8 checkpoint: every rank raises, none reads |
| test_a_temporal_patch_tower_round_trips... | a video tower (2 frames): save_hf, from_hf, load_hf: same features |
| test_mimo_load_hf_trains_like_one_process | `MimoModel.load_hf` on language tp2·dp2 + FSDP2 (colocated with vision dp4, meta-built): oracle numbers of a one-process model loaded the same way; each rank reads under 60% of the checkpoint |
| test_load_hf_reads_only_the_block_... | language tp2: a row-parallel weight's columns read alone, not the tensor |
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dtensor_mimo import MimoLayout, MimoModel, Parallelism
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
)
from dtensor_mimo.models.hf.safetensors import SafetensorsDir
from tests.harness import run_on_ranks
from tests.test_mimo import Case, _distributed, check_against_reference

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=256)),
    "llama3.2_tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    # Mistral-Nemo's kind: head_dim given, hidden_size not a multiple of the heads (32 / 6)
    "mistral_head_dim": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None, num_attention_heads=6,
                                                                     head_dim=16)),
}


def _write(path: str, family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**(SMALL | extra | overrides))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF zero-initializes biases and norms: make every tensor matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


TOKENS = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_family_matches_transformers(family: str, tmp_path) -> None:
    hf = _write(str(tmp_path / "hf"), family)
    llama = Llama(LlamaConfig.from_hf(str(tmp_path / "hf")))
    load_hf(llama, str(tmp_path / "hf"))
    with torch.no_grad():
        want = hf(TOKENS).logits
        torch.testing.assert_close(llama(TOKENS), want, rtol=0, atol=1e-5)
    save_hf(llama, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("edit", ["no_original_max_position_embeddings", "rope_theta_outside_rope_parameters"])
def test_rope_fields_left_to_transformers_fallbacks(edit: str, tmp_path) -> None:
    """A llama3 rope whose config.json leaves out original_max_position_embeddings (transformers
    takes max_position_embeddings), or keeps rope_theta beside rope_parameters instead of in it
    (transformers takes the top-level one): the logits of transformers reading the same directory."""
    path = str(tmp_path / "hf")
    _write(path, "llama3.1")
    file = tmp_path / "hf" / "config.json"
    config = json.loads(file.read_text())
    if edit == "no_original_max_position_embeddings":
        del config["rope_parameters"]["original_max_position_embeddings"]
    else:
        config["rope_theta"] = config["rope_parameters"].pop("rope_theta")
    file.write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    with torch.no_grad():
        torch.testing.assert_close(llama(TOKENS), hf(TOKENS).logits, rtol=0, atol=1e-5)


def test_sharded_checkpoint_and_bf16(tmp_path) -> None:
    _write(str(tmp_path / "hf"), "qwen2")
    llama = Llama(LlamaConfig.from_hf(str(tmp_path / "hf")))
    load_hf(llama, str(tmp_path / "hf"))
    llama = llama.to(torch.bfloat16)
    save_hf(llama, str(tmp_path / "out"), max_shard_bytes=4096)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 3
    again = Llama(LlamaConfig.from_hf(str(tmp_path / "out"))).to(torch.bfloat16)
    load_hf(again, str(tmp_path / "out"))
    for (name, a), b in zip(llama.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
    independent = {}  # read by the safetensors package itself
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        independent |= safetensors_torch.load_file(str(file))
    assert all(t.dtype == torch.bfloat16 for t in independent.values())
    assert torch.equal(independent["model.embed_tokens.weight"], llama.tok_embeddings.weight)
    assert torch.equal(independent["model.layers.1.self_attn.v_proj.bias"], llama.layers["1"].attention.wv.bias)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(back.model.layers[0].mlp.down_proj.weight, llama.layers["0"].feed_forward.w2.weight,
                               rtol=0, atol=0)


def test_a_truncated_shard_is_refused_before_any_read(tmp_path) -> None:
    """A shard cut short (an interrupted download) is named when the directory is opened (every
    rank opens every file, before the ranks agree to read), not met mid-read on the ranks whose
    rows lie past the cut."""
    _write(str(tmp_path / "hf"), "qwen2")
    llama = Llama(LlamaConfig.from_hf(str(tmp_path / "hf")))
    save_hf(llama, str(tmp_path / "out"), max_shard_bytes=4096)
    last = sorted((tmp_path / "out").glob("*.safetensors"))[-1]
    size = last.stat().st_size
    with open(last, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"{last.name}: truncated: .* up to byte {size}, the file has {size - 100}"):
        load_hf(Llama(LlamaConfig.from_hf(str(tmp_path / "out"))), str(tmp_path / "out"))


def test_blocks_read_are_the_tensors_slices(tmp_path) -> None:
    """`SafetensorsDir.read` of rows of dim 0 and slices of the other dims, of tensors of 1 to 4
    dims and several dtypes that the safetensors package wrote: each block equals the written
    tensor sliced by torch (a rank's Shard(0) rows of a conv patch embedding [out, C, P, P] start
    ``first * C * P * P`` elements in, not ``first * P``)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, generator=gen), "b": torch.randn(6, 5, generator=gen).bfloat16(),
               "c": torch.randn(5, 3, 4, generator=gen, dtype=torch.float64),
               "d": torch.randint(-9, 9, (4, 3, 2, 5), generator=gen, dtype=torch.int32),
               "e": torch.rand(5, 2, 3, generator=gen) > 0.5, "f": torch.tensor(2.5)}
    os.makedirs(tmp_path / "st")
    safetensors_torch.save_file(tensors, str(tmp_path / "st" / "model.safetensors"))
    d = SafetensorsDir(str(tmp_path / "st"))
    for name, t in tensors.items():
        assert torch.equal(d.read(name), t) and d.read(name).dtype == t.dtype, name
        if t.dim() == 0:
            continue
        for rows in (slice(0, 2), slice(1, 3), slice(2, t.shape[0]), slice(3, 3)):
            assert torch.equal(d.read(name, rows), t[rows]), (name, rows)
            box = tuple(slice(1, n) for n in t.shape[1:])
            assert torch.equal(d.read(name, rows, box), t[(rows, *box)]), (name, rows, box)


def test_a_directory_transformers_rewrote_as_one_file_loads_that_file(tmp_path) -> None:
    """transformers' `save_pretrained` into a directory it had written sharded removes the old
    shards but leaves their index, and reads ``model.safetensors`` first: `load_hf` reads the
    same file (not the index, whose shards are gone) and gives transformers' logits."""
    path = str(tmp_path / "hf")
    _write(path, "qwen2", seed=1).save_pretrained(path, max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    hf = _write(path, "qwen2", seed=2)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # left behind
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    with torch.no_grad():
        torch.testing.assert_close(llama(TOKENS), hf(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, overrides, message", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    ("llama3.2_tied", dict(attention_bias=True), "attention_bias=true"),
    ("llama3.2_tied", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama3.2_tied", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
])
def test_refused_configs_are_named(family: str, overrides: dict, message: str, tmp_path) -> None:
    _write(str(tmp_path / "hf"), family, **overrides)
    with pytest.raises(ValueError, match="the library's Llama cannot express .*" + message.replace("(", r"\(")):
        LlamaConfig.from_hf(str(tmp_path / "hf"))


def test_checkpoints_that_train_with_dropout_are_warned_of_by_name(tmp_path) -> None:
    """transformers trains a checkpoint whose config sets a dropout with it; the library's models
    have none, and trained it without, in silence: each model's config names the fields, in a
    warning (a prediction or a frozen tower loads as before)."""
    import transformers

    _write(str(tmp_path / "lm"), "qwen2", attention_dropout=0.1)
    with pytest.warns(UserWarning, match=r"attention_dropout=0.1: the library's models have no dropout and train "
                                         r"this checkpoint without it"):
        LlamaConfig.from_hf(str(tmp_path / "lm"))
    transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8, attention_dropout=0.2).save_pretrained(tmp_path / "v")
    with pytest.warns(UserWarning, match=r"attention_dropout=0.2: the library's models have no dropout"):
        ViTConfig.from_hf(str(tmp_path / "v"))
    transformers.WhisperConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2, decoder_layers=1,
                               decoder_attention_heads=2, num_mel_bins=16, max_source_positions=16, dropout=0.1,
                               activation_dropout=0.05).save_pretrained(tmp_path / "a")
    with pytest.warns(UserWarning, match=r"dropout=0.1, activation_dropout=0.05: the library's models have no "
                                         r"dropout .* set dropout and activation_dropout to 0.0"):
        AudioConfig.from_hf(str(tmp_path / "a"))


def _config_warnings(path: str) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LlamaConfig.from_hf(path)
    return [str(w.message) for w in caught]


def test_a_dropout_warning_is_said_once_in_a_world(tmp_path) -> None:
    """Every rank reads the config alike: the warning comes from rank 0 alone (at 1,000 ranks the
    log would hold it 1,000 times)."""
    _write(str(tmp_path / "lm"), "qwen2", attention_dropout=0.1)
    said = run_on_ranks(_config_warnings, 2, str(tmp_path / "lm"), timeout=60)
    assert [len([w for w in r if "attention_dropout=0.1" in w]) for r in said] == [1, 0], said


def test_load_hf_names_a_config_mismatch(tmp_path) -> None:
    _write(str(tmp_path / "hf"), "qwen2")
    with pytest.raises(ValueError, match=r"config differs from the checkpoint's \(norm_eps: module 1e-05, "
                                         r"checkpoint 1e-06; qkv_bias: module False, checkpoint True\); "
                                         r"build the module from LlamaConfig.from_hf"):
        load_hf(Llama(LlamaConfig.tiny()), str(tmp_path / "hf"))


def _distributed_counting_reads(case: Case) -> list[dict]:
    """`_distributed`, recording in the first record how many checkpoint elements this rank read."""
    read, count = SafetensorsDir.read, [0]

    def counting(self, *args, **kwargs):
        out = read(self, *args, **kwargs)
        count[0] += out.numel()
        return out

    SafetensorsDir.read = counting
    try:
        records = _distributed(case)
    finally:
        SafetensorsDir.read = read
    records[0]["elements_read"] = count[0]
    return records


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_mimo_load_hf_trains_like_one_process(family: str, tmp_path) -> None:
    """Qwen2 (q/k/v biases sharded with their rows) and Qwen3 (per-head q/k norms that each tp
    rank applies to its own heads: their gradients are summed over tp)."""
    path = str(tmp_path / "hf")
    hf = _write(path, family, num_attention_heads=8, num_key_value_heads=4)
    case = Case({"vision": Parallelism(dp=4), "language": Parallelism(dp=2, tp=2)},
                offsets={"vision": 0, "language": 0}, meta=True, language_hf=path)
    per_rank = check_against_reference(case, run=_distributed_counting_reads)
    total = sum(p.numel() for p in hf.parameters())
    for rank, records in enumerate(per_rank):
        assert 0 < records[0]["elements_read"] < 0.6 * total, f"rank {rank} read {records[0]['elements_read']} of {total}"


# --------------------------------------------------------------------------------------------
# vision towers and LLaVA
# --------------------------------------------------------------------------------------------

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, patch_size=4)


def randomized(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """`model` with every tensor perturbed (HF zero-initializes biases and norms: make each matter)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def tiny_whisper() -> torch.nn.Module:
    """A tiny randomized transformers Whisper (8 mel bins, 16 positions, 2 encoder layers)."""
    config = transformers.WhisperConfig(
        num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=16, vocab_size=50, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3)
    return randomized(transformers.WhisperModel(config))


def _images(size: int) -> torch.Tensor:
    return torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(2))


def test_siglip_tower_matches_transformers(tmp_path) -> None:
    """SigLIP: tanh GELU, a final norm, an image size the patch does not divide (30 / 4: the
    leftover pixels dropped); `save_hf` -> transformers -> the same features."""
    hf = randomized(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION, image_size=30)))
    hf.save_pretrained(tmp_path / "hf")
    vit = ViT(ViTConfig.from_hf(str(tmp_path / "hf")))
    load_hf(vit, str(tmp_path / "hf"))
    with torch.no_grad():
        want = hf(pixel_values=_images(30)).last_hidden_state
        torch.testing.assert_close(vit(_images(30)), want, rtol=0, atol=1e-5)
    save_hf(vit, str(tmp_path / "out"))
    back = transformers.SiglipVisionModel.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(pixel_values=_images(30)).last_hidden_state, want, rtol=0, atol=1e-5)


def test_clip_tower_matches_transformers(tmp_path) -> None:
    """CLIP: class token (attends, then dropped), pre-LayerNorm, quick GELU, no patch bias; its
    patch features are `last_hidden_state` without the class token (no final norm)."""
    hf = randomized(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION, image_size=16)))
    hf.save_pretrained(tmp_path / "hf")
    vit = ViT(ViTConfig.from_hf(str(tmp_path / "hf")))
    load_hf(vit, str(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(vit(_images(16)), hf(pixel_values=_images(16)).last_hidden_state[:, 1:],
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="only SigLIP-style towers"):
        save_hf(vit, str(tmp_path / "out"))


def test_llava_checkpoint_fills_tower_projector_and_language_model(tmp_path) -> None:
    """One LLaVA directory: the tower up to vision_feature_layer -2, the projector, the Llama
    (tensors under their LLaVA prefixes); image features equal `get_image_features`, logits
    equal the language model's."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, image_size=16),
        text_config=transformers.LlamaConfig(**(SMALL | dict(vocab_size=80))), image_token_index=70)
    hf = randomized(transformers.LlavaForConditionalGeneration(config))
    hf.save_pretrained(tmp_path / "llava")
    path = str(tmp_path / "llava")
    vit_config = ViTConfig.from_hf(path)
    assert vit_config.n_layers == 2 and not vit_config.final_norm  # 3 layers, features after the second
    _assert_llava_matches(hf, path, 32, 64)


def _assert_llava_matches(hf, path: str, dim: int, tokens: int) -> None:
    """The library's tower + projection and decoder loaded from LLaVA directory `path` (language
    width `dim`): the image features and the logits of `tokens` tokens of transformers' `hf`."""
    encoder = ModalityEncoder(ViT(ViTConfig.from_hf(path)), Projection(32, dim))
    load_hf(encoder.encoder, path)
    load_hf(encoder.projection, path)
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    with torch.no_grad():
        features = hf.model.get_image_features(pixel_values=_images(16))
        features = features if isinstance(features, torch.Tensor) else getattr(features, "pooler_output", features)
        features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features.flatten(0, 1)
        torch.testing.assert_close(encoder(_images(16)), features, rtol=0, atol=1e-5)
        tokens = TOKENS[:, :tokens]
        torch.testing.assert_close(llama(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-5)


def test_whisper_encoder_matches_transformers(tmp_path) -> None:
    """Whisper: no k_proj bias, a frozen position table; full-length input (Whisper's own rule)."""
    hf = tiny_whisper()
    hf.save_pretrained(tmp_path / "hf")
    audio_config = AudioConfig.from_hf(str(tmp_path / "hf"))
    encoder = AudioEncoder(audio_config)
    load_hf(encoder, str(tmp_path / "hf"))
    assert not encoder.pos_embed.requires_grad and encoder.layers["0"].attn.wk.bias is None
    mels = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(encoder(mels), hf.encoder(mels).last_hidden_state, rtol=0, atol=1e-5)


def test_llava_from_pretrained_example_learns(tmp_path) -> None:
    """examples/llava_from_pretrained.py on tiny checkpoints written here: a SigLIP tower on rank
    0 (frozen), a Qwen2 decoder on tp2 (ranks 1-2) with q/k/v biases; it trains (the synthetic
    batches are memorized) and every rank runs to the end."""
    randomized(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION, image_size=16))) \
        .save_pretrained(tmp_path / "siglip")
    _write(str(tmp_path / "qwen2"), "qwen2")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "llava_from_pretrained.py")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node=3", example, "--vision", str(tmp_path / "siglip"),
                          "--language", str(tmp_path / "qwen2"), "--steps", "12", "--language-tp", "2", "--lr", "1e-2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses


def test_transformers_v4_config_layout_reads_the_same(tmp_path) -> None:
    """transformers v4 wrote `rope_theta` and `rope_scaling` (with "type" in older files) where
    v5 writes `rope_parameters`: both give the same config."""
    _write(str(tmp_path / "hf"), "llama3.1")
    v5 = LlamaConfig.from_hf(str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    assert LlamaConfig.from_hf(str(tmp_path / "hf")) == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling.factor == 8.0 and v5.norm_eps == 1e-5


def test_llava_variants_the_modules_cannot_express_are_named(tmp_path) -> None:
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, image_size=16),
        text_config=transformers.LlamaConfig(**(SMALL | dict(vocab_size=80))), image_token_index=70)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(tmp_path / "llava")
    path, file = str(tmp_path / "llava"), tmp_path / "llava" / "config.json"
    original = json.loads(file.read_text())
    file.write_text(json.dumps(original | {"projector_hidden_act": "relu"}))
    with pytest.raises(ValueError, match=r"projector_hidden_act='relu', multimodal_projector_bias=True: the "
                                         r"Projection is Linear, exact GELU, Linear, with biases"):
        load_hf(Projection(32, 32), path)
    siglip = original["vision_config"] | {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh"}
    file.write_text(json.dumps(original | {"vision_config": siglip}))
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='default' with a siglip_vision_model: "
                                         r"the ViT keeps exactly the patch tokens \(full\)"):
        ViTConfig.from_hf(path)


def _load_mismatched(path: str) -> str:
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.tiny())  # not the checkpoint's config
    vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))
    model = MimoModel(layout, llama, {"vision": vision})
    try:
        model.load_hf({"language": path})
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "loaded"


def test_mimo_load_hf_refuses_on_every_rank(tmp_path) -> None:
    """A checkpoint only the language rank can judge: it names the problem, the vision rank
    raises too (no rank goes on into training collectives)."""
    _write(str(tmp_path / "hf"), "qwen2")
    vision_rank, language_rank = run_on_ranks(_load_mismatched, 2, str(tmp_path / "hf"), timeout=60)
    assert "config differs from the checkpoint's" in language_rank and "qkv_bias" in language_rank
    assert vision_rank.startswith("MimoModel.load_hf: 1 rank(s) found the checkpoints")


def _without_class_defaults(config: dict) -> dict:
    """`config` as transformers v4 wrote a nested config (a LLaVA's text_config / vision_config, a
    SigLIP model's vision_config): without the fields equal to its class's defaults."""
    default = transformers.AutoConfig.for_model(config["model_type"]).to_dict()
    return {k: v for k, v in config.items() if k == "model_type" or k not in default or default[k] != v}


def test_fields_left_at_transformers_defaults_read_as_those(tmp_path) -> None:
    """A LLaVA directory whose nested configs leave out what equals transformers' defaults (as
    llava-1.5's: its CLIP tower has no hidden_act or layer_norm_eps, its Llama no hidden_size):
    the same features and logits as transformers reading the same directory."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, image_size=16),
        text_config=transformers.LlamaConfig(**(SMALL | dict(vocab_size=80, hidden_size=4096, head_dim=2))),
        image_token_index=70)
    randomized(transformers.LlavaForConditionalGeneration(config)).save_pretrained(tmp_path / "llava")
    file = tmp_path / "llava" / "config.json"
    written = json.loads(file.read_text())
    stripped = {**written, "vision_config": _without_class_defaults(written["vision_config"]),
                "text_config": _without_class_defaults(written["text_config"])}
    assert not {"hidden_act", "layer_norm_eps"} & set(stripped["vision_config"])
    assert not {"hidden_size", "rms_norm_eps"} & set(stripped["text_config"])
    file.write_text(json.dumps(stripped))
    path = str(tmp_path / "llava")
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    _assert_llava_matches(hf, path, 4096, 16)


def test_a_sliding_window_left_at_mistrals_default_is_refused(tmp_path) -> None:
    """A Mistral config without sliding_window has transformers' 4096-token window (a v4 nested
    config leaves it out): refused like a written one, not read as full attention."""
    _write(str(tmp_path / "hf"), "mistral", sliding_window=4096)
    file = tmp_path / "hf" / "config.json"
    file.write_text(json.dumps(_without_class_defaults(json.loads(file.read_text()))))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).sliding_window == 4096
    with pytest.raises(ValueError, match="the library's Llama cannot express sliding_window=4096"):
        LlamaConfig.from_hf(str(tmp_path / "hf"))


def test_default_table_is_transformers_own() -> None:
    from dtensor_mimo.models.config_json import DEFAULTS

    for model_type, fields in DEFAULTS.items():
        default = transformers.AutoConfig.for_model(model_type).to_dict()
        default.setdefault("rope_theta", (default.get("rope_parameters") or {}).get("rope_theta"))
        assert {k: default[k] for k in fields} == fields, model_type


def test_clip_tower_without_layer_norm_eps_takes_clips_default(tmp_path) -> None:
    """A CLIP tower whose config.json leaves out layer_norm_eps has CLIP's 1e-5 (not SigLIP's 1e-6):
    the features of transformers reading the same directory."""
    randomized(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION, image_size=16))) \
        .save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    file.write_text(json.dumps({k: v for k, v in json.loads(file.read_text()).items() if k != "layer_norm_eps"}))
    hf = transformers.CLIPVisionModel.from_pretrained(str(tmp_path / "hf")).eval()
    vit = ViT(ViTConfig.from_hf(str(tmp_path / "hf")))
    load_hf(vit, str(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(vit(_images(16)), hf(pixel_values=_images(16)).last_hidden_state[:, 1:],
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind, tower, layer", [
    ("LlavaNext", "CLIP", -2),  # llava-v1.6: features after all but the last block, class token dropped
    ("LlavaOnevision", "Siglip", -1),  # every block, before post_layernorm, every token
])
@pytest.mark.parametrize("written", [True, False])
def test_llava_kin_take_their_feature_layer(kind: str, tower: str, layer: int, written: bool, tmp_path) -> None:
    """LLaVA-NeXT / -OneVision directories (LLaVA's tower, projector and decoder names): the ViT
    is the tower up to their vision_feature_layer, as the model's own, also when config.json leaves
    it out at the model type's default (as transformers v4 wrote it) — not the whole tower."""
    text = transformers.Qwen2Config(**(SMALL | dict(vocab_size=80)))
    config = getattr(transformers, kind + "Config")(
        vision_config=getattr(transformers, tower + "VisionConfig")(**VISION, image_size=16), text_config=text,
        image_token_index=70, image_grid_pinpoints=[[16, 16]])
    hf = randomized(getattr(transformers, kind + "ForConditionalGeneration")(config))
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    written_config = json.loads(file.read_text())
    assert written_config["vision_feature_layer"] == layer
    if not written:
        file.write_text(json.dumps({k: v for k, v in written_config.items()
                                    if k not in ("vision_feature_layer", "vision_feature_select_strategy")}))
    vit = ViT(ViTConfig.from_hf(str(tmp_path / "hf")))
    load_hf(vit, str(tmp_path / "hf"))
    with torch.no_grad():
        hidden = hf.model.vision_tower(_images(16), output_hidden_states=True).hidden_states[layer]
        want = hidden[:, 1:] if tower == "CLIP" else hidden
        torch.testing.assert_close(vit(_images(16)), want, rtol=0, atol=1e-5)


def _load_anyres(path: str) -> str:
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.from_hf(path))
    vit = ViT(ViTConfig.from_hf(path))
    model = MimoModel(layout, llama, {"vision": ModalityEncoder(vit, Projection(vit.config.dim, llama.config.dim))})
    try:
        model.load_hf({"vision": path, "language": path})
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "loaded"


@pytest.mark.parametrize("kind, tower", [("LlavaNext", "CLIP"), ("LlavaOnevision", "Siglip")])
def test_an_anyres_llava_directory_is_refused_beyond_its_tower(kind: str, tower: str, tmp_path) -> None:
    """A LLaVA-NeXT / -OneVision directory ("anyres") is not LLaVA-1.5: its model cuts each image into
    a base image and grid tiles and appends its learned image_newline after each row of the tiles'
    features (transformers' pack_image_features: 52 rows for a 16x32 image here, not the tower's 16).
    Its tower, projector and decoder loaded silently (image_newline dropped, no tiles): a model that is
    not the checkpoint's was trained. Its tower alone still loads; the projector, and so the encoder
    of a MimoModel and the trainer's encoder, are refused by name on every rank, saying what to use."""
    from dtensor_mimo.train.config import ConfigError, EncoderSection, TrainerConfig
    from dtensor_mimo.train.modules import resolve_encoder

    text = transformers.Qwen2Config(**(SMALL | dict(vocab_size=80)))
    config = getattr(transformers, kind + "Config")(
        vision_config=getattr(transformers, tower + "VisionConfig")(**VISION, image_size=16), text_config=text,
        image_token_index=70, image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    hf = randomized(getattr(transformers, kind + "ForConditionalGeneration")(config))
    path = str(tmp_path / "hf")
    hf.save_pretrained(path)
    # the reference: transformers' own features of one 16x32 image (a base image and two tiles)
    with torch.no_grad():
        rows = hf.model.get_image_features(pixel_values=torch.randn(1, 3, 3, 16, 16),
                                           image_sizes=torch.tensor([[16, 32]])).pooler_output[0].shape[0]
    vit = ViT(ViTConfig.from_hf(path))
    assert rows > vit.config.num_patches == 16
    assert any(n.endswith("image_newline") for n in SafetensorsDir(path).names())
    load_hf(vit, path)  # the tower is the tower
    message = "cuts each image into a base image and grid tiles"
    with pytest.raises(ValueError, match=message):
        load_hf(Projection(32, 32), path)
    vision_rank, language_rank = run_on_ranks(_load_anyres, 2, path, timeout=60)
    assert message in vision_rank and "image_newline" in vision_rank and "LLaVA-1.5" in vision_rank, vision_rank
    assert language_rank.startswith("MimoModel.load_hf: 1 rank(s) found the checkpoints"), language_rank
    with pytest.raises(ConfigError, match=f"model.encoders.vision.hf = '{path}': .*{message}"):
        resolve_encoder(TrainerConfig(), "vision", EncoderSection(hf=path))


@pytest.mark.parametrize("kind", ["llava", "llava_next_video"])
def test_an_anyres_directory_is_known_by_its_grid_pinpoints_or_its_type(kind: str, tmp_path) -> None:
    """`anyres_problem`: any ``image_grid_pinpoints`` is anyres, whatever the model_type says (the
    original LLaVA-1.6 directories are model_type 'llava' with image_grid_pinpoints), and
    LLaVA-NeXT-Video is anyres by its type alone (a config.json without the pinpoints)."""
    from dtensor_mimo.models.hf.vision import check_projector

    config = {"model_type": kind, "projector_hidden_act": "gelu"}
    if kind == "llava":
        config["image_grid_pinpoints"] = [[336, 672], [672, 336]]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"model_type '{kind}' is an \"anyres\" LLaVA"):
        check_projector(str(tmp_path))
    with open(tmp_path / "config.json", "w") as f:  # LLaVA-1.5: no pinpoints, its own type
        json.dump({"model_type": "llava", "projector_hidden_act": "gelu"}, f)
    check_projector(str(tmp_path))


@pytest.mark.parametrize("layer", [-5, 4])
def test_a_feature_layer_outside_the_tower_is_refused(layer: int, tmp_path) -> None:
    """A vision_feature_layer beyond the tower's hidden states (3 blocks: -4..3) names itself, not
    a ViT of no blocks."""
    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**VISION),
                                      text_config=transformers.Qwen2Config(**SMALL), vision_feature_layer=layer)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"vision_feature_layer={layer} is outside the tower's 3 blocks"):
        ViTConfig.from_hf(str(tmp_path))
    config.vision_feature_layer = -4  # the embeddings: in range
    config.save_pretrained(tmp_path)
    assert ViTConfig.from_hf(str(tmp_path)).n_layers == 0


def _quantize(path: str, dtype: torch.dtype, quantization_config: dict | None) -> None:
    """Rewrite the Llama-family checkpoint at `path` as a quantized one stores its weights (as
    Qwen3-8B-FP8 or a compressed-tensors int8 model): every projection in `dtype` with a scale
    beside it, and `quantization_config` in config.json."""
    tensors = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        if name.endswith("_proj.weight"):
            out[name] = (value * 100).to(dtype)
            out[name + "_scale"] = torch.full((value.shape[0], 1), 0.01)
        else:
            out[name] = value
    safetensors_torch.save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            config = json.load(f)
        with open(file, "w") as f:
            json.dump(config | {"quantization_config": quantization_config}, f)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("dtype, quantization_config, message", [
    (torch.float8_e4m3fn, FP8_CONFIG, r"quantization_config \(quant_method 'fp8'\)"),
    (torch.int8, {"quant_method": "compressed-tensors", "format": "int-quantized"},
     r"quantization_config \(quant_method 'compressed-tensors'\)"),
    (torch.int8, None, r"model.layers.0.self_attn.q_proj.weight: I8"),  # no config says so: the dtype does
    (torch.float8_e4m3fn, None, r"model.layers.0.self_attn.q_proj.weight: F8_E4M3"),
])
def test_quantized_checkpoints_are_refused_before_any_read(dtype, quantization_config, message, tmp_path) -> None:
    """A quantized checkpoint's integer / float8 weights mean something only with their scales:
    refused by name while checking (plan_hf), never read as plain numbers or failing mid-read."""
    path = str(tmp_path / "hf")
    _write(path, "qwen2")
    _quantize(path, dtype, quantization_config)
    llama = Llama(LlamaConfig.from_hf(path))
    read = []
    original = SafetensorsDir.read
    SafetensorsDir.read = lambda self, *a, **k: read.append(a) or original(self, *a, **k)
    try:
        with pytest.raises(ValueError, match=message):
            load_hf(llama, path)
    finally:
        SafetensorsDir.read = original
    assert not read


def _load_quantized(path: str) -> str:
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.from_hf(path))
    vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))
    model = MimoModel(layout, llama, {"vision": vision})
    try:
        model.load_hf({"language": path})
    except (ValueError, RuntimeError, KeyError) as error:
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_mimo_load_hf_refuses_a_quantized_checkpoint_on_every_rank(tmp_path) -> None:
    """An FP8 checkpoint (Qwen3-8B-FP8's layout): the language rank names it while checking, and
    the vision rank raises too, rather than the language rank failing alone mid-read while the
    other goes on into training collectives."""
    path = str(tmp_path / "hf")
    _write(path, "qwen2")
    _quantize(path, torch.float8_e4m3fn, FP8_CONFIG)
    vision_rank, language_rank = run_on_ranks(_load_quantized, 2, path, timeout=60)
    assert "quantization_config" in language_rank, language_rank
    assert vision_rank.startswith("RuntimeError: MimoModel.load_hf: 1 rank(s) found the checkpoints"), vision_rank


def test_a_temporal_patch_tower_round_trips_through_save_hf(tmp_path) -> None:
    """A video tower (temporal_patch = 2: two 3-channel frames stacked into 6 channels) written by
    `save_hf` and read back the way it was built (`from_hf`, the same temporal_patch, as the
    trainer's ``hf`` + ``temporal_patch`` does): the same weights and features, not a kernel
    inflated a second time to 12 channels."""
    import dataclasses

    torch.manual_seed(0)
    config = ViTConfig.tiny(temporal_patch=2)
    tower = ViT(config).eval()
    path = str(tmp_path / "video")
    save_hf(tower, path)
    back = ViT(dataclasses.replace(ViTConfig.from_hf(path), temporal_patch=2)).eval()
    assert back.config.in_channels == 3 and back.config.item_channels == 6
    load_hf(back, path)
    assert torch.equal(back.patch_embed.weight, tower.patch_embed.weight)
    x = torch.randn(2, 6, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(back(x), tower(x), rtol=0, atol=0)
    # transformers reads it as a SigLIP tower of the stacked channels: the same features
    hf = transformers.SiglipVisionModel.from_pretrained(path).eval()
    assert hf.config.num_channels == 6
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).last_hidden_state, tower(x), rtol=1e-5, atol=1e-5)



def _reads_per_block(path: str) -> list[tuple[str, int, int]]:
    """`MimoModel.load_hf` of a tp2 language model (FSDP off: each rank holds half of every
    split weight, a row-parallel weight's columns among them): per block of a parameter this rank
    fills, (checkpoint tensor, the block's elements, the most elements one read of it made)."""
    from dtensor_mimo import ParallelOptions
    from dtensor_mimo.models.hf.convert import Source

    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)},
                        offsets={"vision": 0, "language": 0})
    layout.init_meshes("cpu")
    with torch.device("meta"):
        llama = Llama(LlamaConfig.from_hf(path))
        vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, llama.config.dim, hidden_dim=64))
    model = MimoModel(layout, llama, {"vision": vision},
                      options={n: ParallelOptions(fsdp=False) for n in ("vision", "language")})
    model.init_weights({"vision": 1, "language": 2})
    read, source_read, blocks, made = SafetensorsDir.read, Source.read, [], [0]

    def counting(self, *args, **kwargs):
        out = read(self, *args, **kwargs)
        made[0] = max(made[0], out.numel())
        return out

    def block(self, files, offset, shape):
        made[0] = 0
        out = source_read(self, files, offset, shape)
        blocks.append((self.name, math.prod(shape), made[0]))
        return out

    SafetensorsDir.read, Source.read = counting, block
    try:
        model.load_hf({"language": path})
    finally:
        SafetensorsDir.read, Source.read = read, source_read
    return blocks


def test_load_hf_reads_only_the_block_a_rank_holds(tmp_path) -> None:
    """A tp rank holding the columns of a row-parallel weight (attention output, MLP down
    projection: ``Shard(1)``) materializes those columns only, never the whole tensor (the
    files are memory-mapped so that a rank owning a shard reads its shard): each read of a
    tensor makes exactly the elements of the block the rank holds (heads stay whole at tp2)."""
    path = str(tmp_path / "hf")
    _write(path, "qwen2", num_attention_heads=8, num_key_value_heads=4)
    for rank, blocks in enumerate(run_on_ranks(_reads_per_block, 2, path, timeout=120)):
        assert any(name.endswith("down_proj.weight") for name, _, _ in blocks), blocks
        over = [(name, held, made) for name, held, made in blocks if made != held]
        assert not over, f"rank {rank} read more than it holds (tensor, held, read): {over}"
