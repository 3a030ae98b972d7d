"""Variable tokens per item in the encoders (issue 20, models layer): images at their own size,
clips at their own length, a list of items encoded as one packed sequence with per-item attention.

| test                                                | what (reference)                                     |
|-----------------------------------------------------|------------------------------------------------------|
| test_packed_attention_is_block_diagonal             | `packed_attention` = SDPA with a dense block-diagonal mask, any lengths (zeros too), spans of one and several items |
| test_siglip_dynamic_resolution_matches_transformers | a tiny SigLIP (patch 8, 4x4 learned grid) loaded with `load_hf`: features at 32x32, 48x32, 16x64, 40x24, 35x33 = transformers with `interpolate_pos_encoding=True` (1e-5), final norm and the trainer's tower (hidden states of the last block) |
| test_siglip_dynamic_resolution_gradients_match_transformers | the same tower, float64: gradients of the position table (through the bicubic resize) and the patch weights for 48x32, 16x64, 40x24, 35x33 = transformers' (1e-10) |
| test_clip_dynamic_resolution_matches_transformers   | the same for CLIP (class token per item, pre-norm)   |
| test_packed_equals_per_item                         | ViT (SigLIP- and CLIP-style), audio, `ModalityEncoder`: a list of mixed sizes = the per-item tensor-path calls, values and every parameter's gradient (float64), spans of one and of several items |
| test_tensor_input_unchanged                         | `[N, C, H, W]` as before: dynamic_resolution changes no number at the learned size; a batch at another size = the list path |
| test_compiled_blocks_do_not_recompile_for_new_sizes | per-block `torch.compile`: new mixes of sizes and counts after the warm-up recompile nothing |
| test_whisper_unpadded_clip_matches_transformers     | clips of 7, 20, 32 frames = transformers' WhisperEncoder submodules on the unpadded clip (its positions sliced) |
| test_tokens_for_and_item_rule                       | `tokens_for` on configs, towers, `ModalityEncoder` = the rows a forward gives; `item_rule` per item |
| test_numpy_item_counts_are_integers                 | NumPy integer counts in `ModalityInputs` = Python ints |
| test_bad_inputs_are_named                           | over max_patches, wrong channels, another size without dynamic_resolution, a non-tensor, clips of different lengths without variable_length, max_patches without dynamic_resolution |
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dtensor_mimo.data import BatchError, ModalityInputs
from dtensor_mimo.models import AudioConfig, AudioEncoder, ModalityEncoder, Projection, ViT, ViTConfig, load_hf
from dtensor_mimo.models import layers
from dtensor_mimo.models.layers import packed_attention
from dtensor_mimo.models.protocol import item_rule
from tests.test_hf import randomized, tiny_whisper

transformers = pytest.importorskip("transformers")

SIZES = [(32, 32), (48, 32), (16, 64), (40, 24), (35, 33)]  # (H, W); 35x33 leaves pixels beyond a patch


def _image(h: int, w: int, seed: int, channels: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(channels, h, w, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --------------------------------------------------------------------------------------------
# the attention core
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("span", [1024, 7, 1])
@pytest.mark.parametrize("lengths", [[5], [3, 0, 6, 1, 4], [0, 9, 2, 2, 0], []])
def test_packed_attention_is_block_diagonal(monkeypatch, span, lengths):
    monkeypatch.setattr(layers, "PACKED_SPAN_ROWS", span)  # 7: spans of one item and of several
    g = torch.Generator().manual_seed(0)
    s = sum(lengths)
    q, k, v = (torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    item = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    mask = item[:, None] == item[None, :]
    if s:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        want = q.clone()
    torch.testing.assert_close(packed_attention(q, k, v, lengths), want)
    with pytest.raises(ValueError, match=r"item lengths \[1, 2\] do not sum to the"):
        packed_attention(q, k, v, [1, 2])


# --------------------------------------------------------------------------------------------
# dynamic resolution against transformers
# --------------------------------------------------------------------------------------------

TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
             image_size=32)


def test_siglip_dynamic_resolution_matches_transformers(tmp_path):
    from dtensor_mimo.train.modules import vision_config

    hf = randomized(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TOWER)))
    hf.save_pretrained(tmp_path / "siglip")
    path = str(tmp_path / "siglip")
    # The tower with its final norm (last_hidden_state), and the trainer's (feature_layer -1 for
    # SigLIP: the last block's hidden states, no final norm, as LLaVA takes them).
    full = ViTConfig.from_hf(path)
    trainer = vision_config("model.encoders.vision.hf", path, None)
    assert full.final_norm and not trainer.final_norm and trainer.n_layers == 2
    images = [_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    for config, features in ((full, lambda out: out.last_hidden_state), (trainer, lambda out: out.hidden_states[-1])):
        vit = ViT(dataclasses.replace(config, dynamic_resolution=True, max_patches=64))
        load_hf(vit, path)  # the dynamic-resolution fields are not part of the checkpoint's meaning
        with torch.no_grad():
            rows = vit(images)
            want = [features(hf(pixel_values=im[None], interpolate_pos_encoding=True, output_hidden_states=True))[0]
                    for im in images]
            assert rows.shape == (sum(w.shape[0] for w in want), 32)
            torch.testing.assert_close(rows, torch.cat(want), rtol=0, atol=1e-5)
            for im, w in zip(images, want):  # the tensor path at each size too
                torch.testing.assert_close(vit(im[None])[0], w, rtol=0, atol=1e-5)
    assert [vit.tokens_for(im.shape) for im in images] == [16, 24, 16, 15, 16]


def test_siglip_dynamic_resolution_gradients_match_transformers(tmp_path):
    # What training sees: each size's positions are a bicubic resize of the learned grid, so the
    # grid's gradient is the resize's transpose summed over the sizes of the batch.
    hf = randomized(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TOWER)))
    hf.save_pretrained(tmp_path / "siglip")
    vit = ViT(dataclasses.replace(ViTConfig.from_hf(str(tmp_path / "siglip")), dynamic_resolution=True,
                                  max_patches=64))
    load_hf(vit, str(tmp_path / "siglip"))
    hf, vit = hf.double(), vit.double()
    images = [_image(h, w, seed=i, dtype=torch.float64) for i, (h, w) in enumerate(SIZES[1:])]
    weights = [torch.randn(vit.tokens_for(im.shape), 32, generator=torch.Generator().manual_seed(9 + i),
                           dtype=torch.float64) for i, im in enumerate(images)]
    (vit(images) * torch.cat(weights)).sum().backward()
    sum((hf(pixel_values=im[None], interpolate_pos_encoding=True).last_hidden_state[0] * w).sum()
        for im, w in zip(images, weights)).backward()
    embeddings = hf.embeddings
    torch.testing.assert_close(vit.pos_embed.grad, embeddings.position_embedding.weight.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(vit.patch_embed.weight.grad, embeddings.patch_embedding.weight.grad, rtol=0,
                               atol=1e-10)


def test_clip_dynamic_resolution_matches_transformers(tmp_path):
    hf = randomized(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TOWER)))
    hf.save_pretrained(tmp_path / "clip")
    vit = ViT(dataclasses.replace(ViTConfig.from_hf(str(tmp_path / "clip")), dynamic_resolution=True))
    load_hf(vit, str(tmp_path / "clip"))
    images = [_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    with torch.no_grad():
        # CLIP's patch features: last_hidden_state without the class token (no final norm).
        want = [hf(pixel_values=im[None], interpolate_pos_encoding=True).last_hidden_state[0, 1:] for im in images]
        torch.testing.assert_close(vit(images), torch.cat(want), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# packed = per item
# --------------------------------------------------------------------------------------------


def _vit(**overrides) -> ViT:
    config = ViTConfig.tiny(image_size=16, patch_size=4, dynamic_resolution=True, **overrides)
    return randomized(ViT(config).double(), seed=3).train()


def _audio(**overrides) -> AudioEncoder:
    return randomized(AudioEncoder(AudioConfig.tiny(variable_length=True, **overrides)).double(), seed=3).train()


def _images() -> list[torch.Tensor]:  # 16, 8, 15, 30, 4, 16 tokens (4 px patches)
    return [_image(h, w, seed=i, dtype=torch.float64)
            for i, (h, w) in enumerate([(16, 16), (8, 16), (20, 12), (24, 20), (4, 16), (16, 17)])]


def _clips(n_mels: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(n_mels, t, generator=g, dtype=torch.float64) for t in (32, 1, 7, 20, 2, 13)]


MODELS = {
    "siglip": (lambda: _vit(activation="gelu_tanh"), _images),
    "clip": (lambda: _vit(class_token=True, pre_norm=True, patch_bias=False, final_norm=False,
                          activation="quick_gelu"), _images),
    "audio": (_audio, _clips),
    "audio_stride2": (lambda: _audio(conv_strides=(2, 2)), _clips),
    "modality_encoder": (lambda: ModalityEncoder(_vit(), randomized(Projection(32, 24).double(), seed=4)),
                         _images),
}


def _rows_and_grads(model: torch.nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    rows = run()
    weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(7), dtype=rows.dtype)
    (rows * weights).sum().backward()
    return rows.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("span", [1024, 24])
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_equals_per_item(monkeypatch, name, span):
    monkeypatch.setattr(layers, "PACKED_SPAN_ROWS", span)  # 24: spans of one item and of several
    build, items = MODELS[name]
    model, items = build(), items()
    packed, packed_grads = _rows_and_grads(model, lambda: model(items))
    # Reference: each item alone through the tensor path (a batch of one; the convolution, no mask).
    per_item, per_item_grads = _rows_and_grads(model, lambda: torch.cat([model(x[None]).flatten(0, -2) for x in items]))
    tokens = [model.tokens_for(x.shape) for x in items]
    assert packed.shape[0] == sum(tokens) == per_item.shape[0]
    torch.testing.assert_close(packed, per_item)
    assert packed_grads.keys() == per_item_grads.keys()
    for n in packed_grads:
        torch.testing.assert_close(packed_grads[n], per_item_grads[n], msg=lambda m, n=n: f"{name} {n}: {m}")
    assert any(g.abs().sum() > 0 for g in packed_grads.values())


def test_tensor_input_unchanged():
    fixed = _vit(activation="gelu_tanh")
    fixed.config = dataclasses.replace(fixed.config, dynamic_resolution=False)
    dynamic = _vit(activation="gelu_tanh")
    dynamic.load_state_dict(fixed.state_dict())
    images = torch.stack([_image(16, 16, seed=i, dtype=torch.float64) for i in range(3)])
    with torch.no_grad():
        before = fixed(images)
        assert before.shape == (3, 16, 32)
        assert torch.equal(dynamic(images), before)  # the learned grid: the table itself, no resize
        torch.testing.assert_close(fixed(list(images)), before.flatten(0, 1))  # a list of the same images
        wide = torch.stack([_image(8, 24, seed=i, dtype=torch.float64) for i in range(2)])
        torch.testing.assert_close(dynamic(wide).flatten(0, 1), dynamic(list(wide)))
    with pytest.raises(ValueError, match=r"ViT: expected images \[N, 3, 16, 16\], got \[2, 3, 8, 24\]"):
        fixed(wide)


def test_compiled_blocks_do_not_recompile_for_new_sizes():
    """The item lengths reach the attention core as one `PackedItems`, outside the compiled
    graph: after the warm-up (the second call makes the row count dynamic), new mixes of sizes
    and item counts reuse the compiled blocks."""
    torch._dynamo.reset()
    model = _vit()
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    mixes = [[(16, 16), (8, 8)], [(4, 8), (12, 16), (20, 8)], [(8, 12)] * 5, [(24, 4)], [(4, 4), (16, 20)] * 3]
    for i, mix in enumerate(mixes):
        images = [_image(h, w, seed=j, dtype=torch.float64) for j, (h, w) in enumerate(mix)]
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            model(images).sum().backward()


# --------------------------------------------------------------------------------------------
# Whisper on unpadded clips
# --------------------------------------------------------------------------------------------


def _whisper_reference(encoder, clip: torch.Tensor) -> torch.Tensor:
    """transformers' WhisperEncoder on an unpadded clip. Its forward insists on exactly
    2 * max_source_positions frames (the 30 s window) and adds the whole position table, so run
    its own submodules as that forward does, on the clip's conv output with the position table
    sliced to the clip's length: conv1, GELU, conv2, GELU, + embed_positions[:n], the layers
    (no mask: Whisper attends to every frame), layer_norm."""
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(clip[None])))).transpose(1, 2)
    x = x + encoder.embed_positions.weight[: x.shape[1]]
    for layer in encoder.layers:
        out = layer(x, None)
        x = out[0] if isinstance(out, tuple) else out
    return encoder.layer_norm(x)[0]


def test_whisper_unpadded_clip_matches_transformers(tmp_path):
    hf = tiny_whisper()
    hf.save_pretrained(tmp_path / "whisper")
    audio = AudioEncoder(dataclasses.replace(AudioConfig.from_hf(str(tmp_path / "whisper")), variable_length=True))
    load_hf(audio, str(tmp_path / "whisper"))
    g = torch.Generator().manual_seed(3)
    clips = [torch.randn(8, t, generator=g) for t in (7, 20, 32)]
    with torch.no_grad():
        # The reference built from submodules equals transformers' own forward at full length.
        torch.testing.assert_close(_whisper_reference(hf.encoder, clips[2]),
                                   hf.encoder(clips[2][None]).last_hidden_state[0], rtol=0, atol=1e-6)
        want = torch.cat([_whisper_reference(hf.encoder, c) for c in clips])
        assert want.shape == (4 + 10 + 16, 32)
        torch.testing.assert_close(audio(clips), want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# counting and errors
# --------------------------------------------------------------------------------------------


def test_tokens_for_and_item_rule():
    vit, audio = _vit(max_patches=30), _audio()
    encoder = ModalityEncoder(vit, Projection(32, 24).double())
    images, clips = _images(), _clips()
    assert [encoder.tokens_for(x.shape) for x in images] == [16, 8, 15, 30, 4, 16]
    assert [audio.tokens_for(x.shape) for x in clips] == [16, 1, 4, 10, 1, 7]
    with torch.no_grad():
        assert encoder(images).shape == (89, 24) and audio(clips).shape == (39, 32)
    assert ViTConfig.tiny().tokens_for((3, 16, 16)) == 16  # fixed size: num_patches
    rule = item_rule(encoder)
    assert rule((3, 24, 20), 30) is None and rule((3, 4, 16), 4) is None
    assert rule((3, 24, 20), 16) == "tokens_per_item=16, but the ViT gives 30 rows per image of 24x20 px"
    assert "over the budget max_patches=30" in rule((3, 24, 24), 36)
    assert item_rule(audio)((8, 20), 10) is None
    assert item_rule(audio)((8, 20), 16) == "tokens_per_item=16, but the audio encoder gives 10 rows per clip of 20 frames"


def test_bad_inputs_are_named():
    vit = _vit(max_patches=30)
    with pytest.raises(ValueError, match=r"ViT: image 1 of the 2 in the list has shape \[3, 24, 24\]: 36 patches "
                                         r"\(6 x 6 of 4 px\), over the budget max_patches=30"):
        vit([_image(8, 8, 0, dtype=torch.float64), _image(24, 24, 1, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"image 0 of the 1 in the list has shape \[1, 8, 8\], but the ViT takes "
                                         r"\[3, H, W\] \(in_channels=3\)"):
        vit([_image(8, 8, 0, channels=1, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"smaller than one 4x4 patch"):
        vit([_image(2, 8, 0, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"image 0 of the 1 in the list has a list, not a tensor \[C, H, W\]"):
        vit([[1.0]])
    with pytest.raises(ValueError, match=r"ViT: expected images \[N, 3, H, W\], got \[1, 3, 24, 24\] \(images of "
                                         r"shape \[3, 24, 24\]: 36 patches"):
        vit(_image(24, 24, 0, dtype=torch.float64)[None])
    fixed = ViT(ViTConfig.tiny())
    with pytest.raises(ValueError, match=r"image 0 of the 1 in the list has shape \[3, 8, 16\], but the ViT takes "
                                         r"\[3, 16, 16\] \(ViTConfig\(dynamic_resolution=True\)"):
        fixed([_image(8, 16, 0)])
    with pytest.raises(ValueError, match=r"max_patches=64 is the patch budget of one image under "
                                         r"dynamic_resolution=True \(got dynamic_resolution=False\)"):
        ViTConfig.tiny(max_patches=64)
    with pytest.raises(ValueError, match=r"AudioEncoder: the clips of the list have lengths \[5, 7\] frames; clips "
                                         r"of their own length need AudioConfig\(variable_length=True\)"):
        AudioEncoder(AudioConfig.tiny())([torch.randn(8, 5), torch.randn(8, 7)])
    with pytest.raises(ValueError, match=r"clip 1 of the 2 in the list has shape \[8, 33\], but the audio encoder "
                                         r"takes \[8, frames <= 32\]"):
        _audio()([torch.randn(8, 5).double(), torch.randn(8, 33).double()])
    with pytest.raises(ValueError, match=r"AudioEncoder: a clip of shape \[4, 10\], but the audio encoder takes"):
        _audio().tokens_for((4, 10))


def test_numpy_item_counts_are_integers():
    """Per-item token counts and items per sample computed with NumPy (``np.int64``: a shape
    product, a ``bincount``, an array of counts) are integers like Python's: the same
    `ModalityInputs` as with plain ints (they were refused as "must be integers")."""
    np = pytest.importorskip("numpy")
    images = [_image(8, 16, 0), _image(12, 8, 1), _image(16, 16, 2)]  # 8, 6, 16 tokens (4 px patches)
    plain = ModalityInputs(inputs=images, items_per_sample=(1, 0, 2), tokens_per_item=(8, 6, 16), special_token_id=9)
    products = tuple(np.int64(h // 4) * np.int64(w // 4) for h, w in ((8, 16), (12, 8), (16, 16)))
    for counts, tokens in (((np.int64(1), 0, np.int64(2)), (8, 6, 16)),
                           (np.array([1, 0, 2]), np.array([8, 6, 16])),
                           ((1, 0, 2), products)):
        m = ModalityInputs(inputs=images, items_per_sample=counts, tokens_per_item=tokens, special_token_id=9)
        assert m.items_per_sample == plain.items_per_sample and m.tokens_per_item == plain.tokens_per_item
        assert all(type(n) is int for n in (*m.items_per_sample, *m.tokens_per_item))
        assert m.tokens_per_sample() == [8, 0, 22]
    one = ModalityInputs(inputs=torch.zeros(3, 3, 16, 16), items_per_sample=(1, 2), tokens_per_item=np.int64(16),
                         special_token_id=9)
    assert one.tokens_per_item == 16 and type(one.tokens_per_item) is int and not one.varied
    with pytest.raises(BatchError, match="must be integers"):
        ModalityInputs(inputs=images, items_per_sample=(1, 2), tokens_per_item=(8.0, 6, 16), special_token_id=9)
