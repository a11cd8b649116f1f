"""Decode + process latency per family: AReno's shared path vs a decode-everything baseline.

Workload (fixed seed): a 1024x768 JPEG and a 5 s, 30 fps, 640x360 MP4, each in one user message.
- areno:    MediaDecoder (EXIF/RGB, decode-time frame sampling at the decoder's fps / max frames)
            + Processor (chat template + native processor, spans).
- baseline: what a hand-written loop does: Pillow opens the image, PyAV decodes EVERY frame of the
            video, and the native processor samples frames itself (do_sample_frames=True).
Prints a table and writes JSON (default benchmarks/results/media_processing.json).

    python benchmarks/media_processing.py [--families gemma4 qwen3_5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from areno.media.decoder import MediaDecoder
from areno.media.samples import write_image, write_video
from areno.media.sources import MediaPolicy
from areno.models.tiny import TINY_FAMILIES, build_tiny
from areno.processing import Processor, process_messages


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _baseline(processor: Processor, modality: str, path: Path) -> int:
    from transformers.video_utils import VideoMetadata

    hf = processor.hf_processor
    messages = [
        {"role": "user", "content": [{"type": modality}, {"type": "text", "text": "Describe."}]}
    ]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if modality == "image":
        out = hf(text=[text], images=[Image.open(path).convert("RGB")], return_tensors="pt")
    else:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
            fps = float(stream.average_rate)
        meta = VideoMetadata(
            total_num_frames=len(frames),
            fps=fps,
            duration=len(frames) / fps,
            frames_indices=list(range(len(frames))),
            height=frames.shape[1],
            width=frames.shape[2],
            video_backend="pyav",
        )
        out = hf(
            text=[text],
            videos=[frames],
            return_tensors="pt",
            videos_kwargs={"video_metadata": [meta], "do_sample_frames": True},
        )
    return int(out["input_ids"].shape[1])


def run(families: list[str], repeats: int, workdir: Path) -> list[dict]:
    image = write_image(workdir / "photo.jpg", 1024, 768, seed=0)
    video = write_video(workdir / "clip.mp4", seconds=5.0, fps=30.0, width=640, height=360, seed=0)
    rows = []
    for family in families:
        path = build_tiny(family, workdir / family)
        processor = Processor(path)
        # No decode cache: every repeat pays the full decode, like a first request.
        decoder = MediaDecoder(
            MediaPolicy.for_training(), processor.decode_options(), max_cache_entries=0
        )
        for modality, media in (("image", image), ("video", video)):
            if modality not in processor.adapter.modalities:
                continue
            part = {"type": f"{modality}_url", f"{modality}_url": {"url": str(media)}}
            messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}]
            inputs = process_messages(processor, decoder, messages)
            areno_ms = _median_ms(partial(process_messages, processor, decoder, messages), repeats)
            baseline_ms = _median_ms(partial(_baseline, processor, modality, media), repeats)
            rows.append(
                {
                    "family": family,
                    "modality": modality,
                    "prompt_tokens": inputs.num_prompt_tokens,
                    "placeholder_tokens": inputs.num_tokens(modality),
                    "areno_ms": round(areno_ms, 1),
                    "baseline_ms": round(baseline_ms, 1),
                    "speedup": round(baseline_ms / areno_ms, 2),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", default=list(TINY_FAMILIES), choices=TINY_FAMILIES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/media_processing.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.families, args.repeats, Path(tmp))
    header = f"{'family':<12} {'media':<6} {'prompt tok':>10} {'media tok':>9} {'areno ms':>9} {'baseline ms':>11} {'speedup':>7}"
    print("1024x768 JPEG / 5 s 30 fps 640x360 MP4, decode + process, median of", args.repeats)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['family']:<12} {r['modality']:<6} {r['prompt_tokens']:>10} {r['placeholder_tokens']:>9} "
            f"{r['areno_ms']:>9.1f} {r['baseline_ms']:>11.1f} {r['speedup']:>7.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
