"""Write a tiny "train on your data" setup: random Hugging Face checkpoints and a conversation
dataset, all local (nothing is downloaded), for `examples/llava_tiny.toml`.

    python examples/make_tiny_llava.py --out tiny_llava
    cd tiny_llava && python -m dtensor_mimo.train --config ../examples/llava_tiny.toml

Writes under ``--out``:

- ``ckpt/lm``: a Qwen2 decoder (random weights) with a byte-level BPE tokenizer and a ChatML
  chat template; ``ckpt/siglip``: a SigLIP vision tower (16x16 images, 4x4 patches) with its image
  processor; ``ckpt/whisper``: a Whisper model (16 mel bins, 32 frames) with its feature
  extractor. All written with transformers' own ``save_pretrained``.
- ``data/train.jsonl``, ``data/val.jsonl`` in LLaVA's format, with PNG images of coloured shapes
  ("What is in the image?" -> "a red cross"; two images: "a red cross and a blue ring"), text-only
  samples ("repeat: green blue" -> "green blue"), and ``data/audio_*.jsonl`` with WAV tones
  ("How does it sound?" -> "high").
- with ``--video N``: ``data/video_train.jsonl``, ``data/video_val.jsonl`` (N and N // 4 samples)
  with MP4 clips (16x16 px, 4 frames a second, 1.5-2.5 s, a progress bar on the top row; written
  with PyAV) of a coloured square or cross moving left, right, up or down ("What is moving and
  where?" -> "a red square moving left"), for `examples/llava_video_tiny.toml`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import struct
import wave
from typing import Sequence

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("square", "cross", "ring", "bar")
PITCHES = {"low": 300.0, "mid": 900.0, "high": 2500.0, "shrill": 5000.0}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "a", "and", "what", "is", "in", "the", "image", "are", "these",
         "?", ":", "repeat", "how", "does", "it", "sound", ".", *COLORS, *SHAPES, *PITCHES]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
IMAGE_SIZE, SAMPLE_RATE = 16, 16000
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
VIDEO_SHAPES = ("square", "cross")
VIDEO_RATE, VIDEO_SECONDS, VIDEO_TRAVEL = 4, (1.5, 2.0, 2.5), 8  # frames a second, clip lengths, pixels moved


# ---------------------------------------------------------------------------- checkpoints


def write_tokenizer(path: str) -> int:
    """A byte-level BPE tokenizer (Qwen2's kind) trained on the task's words, with a ChatML
    template and no <image> token: the trainer adds its placeholders, as it must for a real
    tokenizer. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS), *(f"{w}\n" for w in WORDS), *(f" {w}" for w in WORDS)]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL[:2])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return len(tokenizer)


def write_checkpoints(out: str, seed: int = 0) -> None:
    """Random Qwen2, SigLIP and Whisper directories under ``out/ckpt``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    lm = os.path.join(out, "ckpt", "lm")
    vocab = -(-(write_tokenizer(lm) + 2) // 64) * 64  # padded, as Qwen's: the placeholders fit inside
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(lm)

    siglip = os.path.join(out, "ckpt", "siglip")
    vision = transformers.SiglipVisionConfig(image_size=IMAGE_SIZE, patch_size=4, hidden_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=96)
    transformers.SiglipVisionModel(vision).save_pretrained(siglip)
    processor = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    processor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(siglip)

    whisper = os.path.join(out, "ckpt", "whisper")
    audio = transformers.WhisperConfig(vocab_size=64, num_mel_bins=16, d_model=48, encoder_layers=2,
                                       encoder_attention_heads=4, encoder_ffn_dim=96, decoder_layers=1,
                                       decoder_attention_heads=4, decoder_ffn_dim=96, max_source_positions=16,
                                       max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       decoder_start_token_id=1)
    transformers.WhisperModel(audio).save_pretrained(whisper)
    transformers.WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLE_RATE, hop_length=500, chunk_length=1,
                                         n_fft=1024).save_pretrained(whisper)


# ---------------------------------------------------------------------------- data


def draw_shape(color: str, shape: str, rng: random.Random):
    """A 16x16 RGB image of one coloured shape, jittered, on a noisy dark background."""
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    pixels = image.load()
    rgb = COLORS[color]
    cx, cy = 8 + rng.randint(-2, 2), 8 + rng.randint(-2, 2)
    for y in range(IMAGE_SIZE):
        for x in range(IMAGE_SIZE):
            dx, dy = x - cx, y - cy
            inside = {"square": max(abs(dx), abs(dy)) <= 3,
                      "cross": (abs(dx) <= 1 and abs(dy) <= 5) or (abs(dy) <= 1 and abs(dx) <= 5),
                      "ring": 3 <= math.hypot(dx, dy) <= 5,
                      "bar": abs(dy) <= 1 and abs(dx) <= 6}[shape]
            base = rgb if inside else (20, 20, 20)
            pixels[x, y] = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in base)
    return image


def write_tone(path: str, pitch: str, rng: random.Random) -> None:
    """A one-second 16-bit WAV of a noisy tone near `pitch`'s frequency."""
    freq = PITCHES[pitch] * rng.uniform(0.9, 1.1)
    amp = rng.uniform(0.2, 0.8)
    frames = bytearray()
    for t in range(SAMPLE_RATE):
        value = amp * math.sin(2 * math.pi * freq * t / SAMPLE_RATE) + rng.gauss(0, 0.05)
        frames += struct.pack("<h", int(max(-1.0, min(1.0, value)) * 32767))
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(bytes(frames))


def write_images_split(data: str, name: str, n: int, rng: random.Random,
                       sizes: Sequence[tuple[int, int]] = ()) -> None:
    """`n` samples: one image (half), two images (a quarter) or text only (a quarter); with
    `sizes`, each image resized (bicubic) to one ``(H, W)`` of them, drawn at random."""
    from PIL import Image

    os.makedirs(os.path.join(data, "images"), exist_ok=True)
    with open(os.path.join(data, f"{name}.jsonl"), "w") as f:
        for i in range(n):
            kind = rng.random()
            sample = {"id": f"{name}-{i}"}
            if kind < 0.25:
                words = [rng.choice(list(COLORS)) for _ in range(rng.randint(1, 3))]
                question, answer = f"repeat : {' '.join(words)}", " ".join(words)
            else:
                count = 1 if kind < 0.75 else 2
                paths, parts = [], []
                for k in range(count):
                    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
                    path = os.path.join("images", f"{name}-{i}-{k}.png")
                    image = draw_shape(color, shape, rng)
                    if sizes:
                        h, w = rng.choice(sizes)
                        image = image.resize((w, h), Image.BICUBIC)
                    image.save(os.path.join(data, path))
                    paths.append(path)
                    parts.append(f"a {color} {shape}")
                sample["image"] = paths[0] if count == 1 else paths
                question = ("<image>\nwhat is in the image ?" if count == 1
                            else "<image> <image>\nwhat are these ?")
                answer = " and ".join(parts)
            sample["conversations"] = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
            f.write(json.dumps(sample) + "\n")


def write_audio_split(data: str, name: str, n: int, rng: random.Random) -> None:
    """`n` samples, each one tone: "how does it sound ?" -> its pitch word."""
    os.makedirs(os.path.join(data, "audio"), exist_ok=True)
    with open(os.path.join(data, f"audio_{name}.jsonl"), "w") as f:
        for i in range(n):
            pitch = rng.choice(list(PITCHES))
            path = os.path.join("audio", f"{name}-{i}.wav")
            write_tone(os.path.join(data, path), pitch, rng)
            f.write(json.dumps({"id": f"audio-{name}-{i}", "audio": path, "conversations": [
                {"from": "human", "value": "<audio>\nhow does it sound ?"}, {"from": "gpt", "value": pitch}]}) + "\n")


def moving_frames(color: str, shape: str, direction: str, seconds: float, rng: random.Random,
                  timeline: bool = True) -> list:
    """16x16 RGB frames (uint8 arrays) at `VIDEO_RATE` of one shape crossing `VIDEO_TRAVEL`
    pixels in `direction` over `seconds`, on a noisy dark background; with `timeline`, a white
    progress bar on the top row (as a player shows): each frame's place in the clip is in its
    pixels (the tiny 2-layer decoder knows the frames' order only from rotary positions over
    their rows). A single frame still does not tell the direction."""
    import numpy as np

    n = round(seconds * VIDEO_RATE)
    (ux, uy), rgb = DIRECTIONS[direction], np.array(COLORS[color])
    across = 8 + rng.randint(-2, 2)  # the other axis: fixed for the clip
    start = 8 - VIDEO_TRAVEL // 2 + rng.randint(-1, 1)
    y, x = np.mgrid[:IMAGE_SIZE, :IMAGE_SIZE]
    frames = []
    for i in range(n):
        along = start + round(VIDEO_TRAVEL * i / max(1, n - 1))  # from one side to the other
        cx = along if ux > 0 else IMAGE_SIZE - along if ux < 0 else across
        cy = along if uy > 0 else IMAGE_SIZE - along if uy < 0 else across
        dx, dy = np.abs(x - cx), np.abs(y - cy)
        inside = np.maximum(dx, dy) <= 2 if shape == "square" else ((dx == 0) & (dy <= 3)) | ((dy == 0) & (dx <= 3))
        noise = np.array([[[rng.randint(-20, 20) for _ in range(3)] for _ in range(IMAGE_SIZE)]
                          for _ in range(IMAGE_SIZE)])
        frame = np.clip(np.where(inside[..., None], rgb, 20) + noise, 0, 255).astype(np.uint8)
        if timeline:  # a player's progress bar on the top row: how far into the clip the frame is
            frame[0, :round(IMAGE_SIZE * (i + 1) / n)] = 255
        frames.append(frame)
    return frames


def write_clip(path: str, frames: list) -> None:
    """An H.264 MP4 of `frames` at `VIDEO_RATE` frames a second (4:4:4, near lossless), with PyAV."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=VIDEO_RATE)
        stream.width = stream.height = IMAGE_SIZE
        stream.pix_fmt = "yuv444p"
        stream.options = {"crf": "8"}
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())


def write_video_split(data: str, name: str, n: int, rng: random.Random) -> None:
    """`n` samples, each one clip: "what is moving and where ?" -> "a red square moving left"."""
    os.makedirs(os.path.join(data, "videos"), exist_ok=True)
    with open(os.path.join(data, f"video_{name}.jsonl"), "w") as f:
        for i in range(n):
            color, shape, direction = rng.choice(list(COLORS)), rng.choice(VIDEO_SHAPES), rng.choice(list(DIRECTIONS))
            path = os.path.join("videos", f"{name}-{i}.mp4")
            write_clip(os.path.join(data, path), moving_frames(color, shape, direction, rng.choice(VIDEO_SECONDS), rng))
            f.write(json.dumps({"id": f"video-{name}-{i}", "video": path, "conversations": [
                {"from": "human", "value": "<video>\nwhat is moving and where ?"},
                {"from": "gpt", "value": f"a {color} {shape} moving {direction}"}]}) + "\n")


def write_data(out: str, train: int = 512, val: int = 64, audio_train: int = 0, audio_val: int = 0,
               seed: int = 0, sizes: Sequence[tuple[int, int]] = (), video_train: int = 0, video_val: int = 0) -> None:
    """The conversation files and their media under ``out/data``; `sizes`: images of those
    ``(H, W)`` (see `write_images_split`), else all 16x16."""
    rng = random.Random(seed)
    data = os.path.join(out, "data")
    write_images_split(data, "train", train, rng, sizes)
    write_images_split(data, "val", val, rng, sizes)
    if audio_train:
        write_audio_split(data, "train", audio_train, rng)
        write_audio_split(data, "val", audio_val, rng)
    if video_train:
        video_rng = random.Random(seed + 1)  # the other files stay as they were without video
        write_video_split(data, "train", video_train, video_rng)
        write_video_split(data, "val", video_val, video_rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tiny_llava")
    parser.add_argument("--train", type=int, default=512, help="training samples")
    parser.add_argument("--val", type=int, default=64, help="held-out samples")
    parser.add_argument("--audio", type=int, default=256, help="audio training samples (a quarter as many held out)")
    parser.add_argument("--video", type=int, default=0, help="video training samples (a quarter as many held "
                        "out; needs PyAV: pip install av)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_checkpoints(args.out, args.seed)
    write_data(args.out, args.train, args.val, args.audio, args.audio // 4, args.seed,
               video_train=args.video, video_val=args.video // 4)
    print(f"wrote {args.out}/ckpt/{{lm,siglip,whisper}} and {args.out}/data")


if __name__ == "__main__":
    main()
