"""Generate an AVE-style audio-visual event dataset: short MP4 clips, one event per clip.

Each clip is `--seconds` long, cut into 1-second segments. The event (one of the 12 classes in
`events.py`) fills one or two consecutive segments, seen as its colored shape and heard as its
sound; the other segments hold distractors (a gray blob, a low hum) over background noise. The
JSONL lines are `Sample.to_json()`: the clip as a local path (or a data URL with `--data-urls`)
and the question in the messages, the label and the event segment in `private`.

    python examples/multimodal/ave_event_recognition/generate_dataset.py --out data/ave \
        --num-train 96 --num-validation 24
"""

from __future__ import annotations

import argparse
import base64
import fractions
import sys
from pathlib import Path

import av
import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from areno.data import Sample
from areno.data.guard import PUBLIC_VALUES
from examples.multimodal.ave_event_recognition.events import EVENTS, Event

SAMPLING_RATE = 16000
SEGMENT_S = 1.0
SPLIT_SEEDS = {"train": 0, "validation": 1}


def question(duration_s: float) -> str:
    names = ", ".join(event.name for event in EVENTS)
    return (
        f"This {duration_s:g}-second clip contains one audio-visual event among distractors. "
        f"Which event is it, and when does it start and end? Classes: {names}. Inspect time "
        "ranges with view_frames and listen, then call submit_answer(label, start_s, end_s)."
    )


def _mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean `(size, size)` mask of `shape`, centred."""
    ys, xs = (np.mgrid[0:size, 0:size] - (size - 1) / 2) / (size / 2)
    r = np.hypot(xs, ys)
    masks = {
        "circle": r <= 0.9,
        "ring": (r <= 0.95) & (r >= 0.55),
        "square": (abs(xs) <= 0.8) & (abs(ys) <= 0.8),
        "triangle": (ys <= 0.8) & (ys >= 2 * abs(xs) - 0.9),
        "cross": ((abs(xs) <= 0.25) | (abs(ys) <= 0.25)) & (r <= 1.2),
        "stripes": (abs(xs) <= 0.9) & (abs(ys) <= 0.9) & ((np.floor((ys + 1) * 3) % 2) == 0),
    }
    return masks[shape]


def _frame(
    size: int, rng: np.random.Generator, event: Event | None, distractor: bool
) -> np.ndarray:
    frame = np.clip(rng.normal(70, 6, size=(size, size, 3)), 0, 255)
    side = size // 2
    y0, x0 = rng.integers(2, size - side - 2, size=2)
    if event is not None:
        frame[y0 : y0 + side, x0 : x0 + side][_mask(event.shape, side, rng)] = event.color
    elif distractor:
        blob = _mask("circle", side // 2, rng)
        frame[y0 : y0 + side // 2, x0 : x0 + side // 2][blob] = (110, 110, 110)
    return frame.astype(np.uint8)


def _sound(event: Event, seconds: float, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(round(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    if event.sound == "tone":
        wave = np.sin(2 * np.pi * event.freq * t) + 0.3 * np.sin(4 * np.pi * event.freq * t)
    elif event.sound == "chirp":
        phase = 2 * np.pi * event.freq * (t + 0.75 * (t % 0.5) ** 2 / 0.5)
        wave = np.sin(phase)
    elif event.sound == "pulses":
        gate = (t * 6) % 1 < 0.35
        wave = np.sin(2 * np.pi * event.freq * t) * gate
    else:  # noise band: white noise through a crude band-pass (an FFT mask)
        spectrum = np.fft.rfft(rng.normal(size=t.size))
        freqs = np.fft.rfftfreq(t.size, 1 / SAMPLING_RATE)
        spectrum[np.abs(freqs - event.freq) > event.freq / 3] = 0
        wave = np.fft.irfft(spectrum, n=t.size)
        wave /= np.abs(wave).max() + 1e-9
    return 0.4 * wave


def render_clip(
    event: Event,
    start_s: float,
    end_s: float,
    *,
    seconds: float,
    fps: float,
    size: int,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The clip's RGB frames and its mono float32 audio."""
    num_segments = round(seconds / SEGMENT_S)
    distractors = rng.random(num_segments) < 0.6
    frames = []
    for i in range(round(seconds * fps)):
        t = i / fps
        segment = min(int(t // SEGMENT_S), num_segments - 1)
        inside = start_s <= t < end_s
        frames.append(_frame(size, rng, event if inside else None, bool(distractors[segment])))
    audio = rng.normal(0, 0.02, size=round(seconds * SAMPLING_RATE))
    t = np.arange(audio.size) / SAMPLING_RATE
    for segment in np.flatnonzero(distractors):
        span = (t >= segment * SEGMENT_S) & (t < (segment + 1) * SEGMENT_S)
        audio[span] += 0.08 * np.sin(2 * np.pi * 100.0 * t[span])
    a, b = round(start_s * SAMPLING_RATE), round(end_s * SAMPLING_RATE)
    audio[a:b] += _sound(event, end_s - start_s, rng)
    return frames, np.clip(audio, -1, 1).astype(np.float32)


def write_mp4(path: Path, frames: list[np.ndarray], audio: np.ndarray, fps: float) -> Path:
    """An MP4 with an H.264 (or MPEG-4) video track and a mono AAC audio track."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        video.thread_count = 1  # tiny frames: threads cost more than they save
        if codec == "libx264":
            video.options = {"preset": "ultrafast"}
        sound = container.add_stream("aac", rate=SAMPLING_RATE)
        sound.layout = "mono"
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            container.mux(video.encode(frame))
        container.mux(video.encode())
        for start in range(0, audio.size, 1024):
            chunk = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(audio[None, start : start + 1024]),
                format="fltp",
                layout="mono",
            )
            chunk.sample_rate, chunk.pts = SAMPLING_RATE, start
            container.mux(sound.encode(chunk))
        container.mux(sound.encode())
    return path


def warmup_call(rng: np.random.Generator, num_segments: int) -> dict:
    """A well-formed submit_answer reply with a label and segment drawn independently of the
    clip: `areno sft --target-key warmup_call` teaches the call format, not the answers."""
    first = int(rng.integers(0, num_segments))
    arguments = {
        "label": EVENTS[int(rng.integers(len(EVENTS)))].name,
        "start_s": first * SEGMENT_S,
        "end_s": (first + 1) * SEGMENT_S,
    }
    return {"tool_calls": [{"name": "submit_answer", "arguments": arguments}]}


def make_split(
    out: Path,
    split: str,
    num_samples: int,
    *,
    seed: int,
    seconds: float,
    fps: float,
    size: int,
    data_urls: bool,
    progress: bool = True,
) -> Path:
    """Write `<out>/media/<split>-NNNNN.mp4` and `<out>/<split>.jsonl`; returns the JSONL path."""
    media = out / "media"
    media.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, SPLIT_SEEDS.get(split, 9)])
    warmup_rng = np.random.default_rng([seed, SPLIT_SEEDS.get(split, 9), 1])
    order: list[int] = []
    while len(order) < num_samples:  # class-balanced blocks
        order += list(rng.permutation(len(EVENTS)))
    num_segments = round(seconds / SEGMENT_S)
    lines = []
    for index in tqdm(range(num_samples), desc=f"{split} clips", disable=not progress):
        event = EVENTS[order[index]]
        length = int(rng.integers(1, 3))
        first = int(rng.integers(0, num_segments - length + 1))
        start_s, end_s = first * SEGMENT_S, (first + length) * SEGMENT_S
        frames, audio = render_clip(
            event, start_s, end_s, seconds=seconds, fps=fps, size=size, rng=rng
        )
        path = write_mp4(media / f"{split}-{index:05d}.mp4", frames, audio, fps)
        url = str(path.resolve())
        if data_urls:
            url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
        content = [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": question(seconds)},
        ]
        private = {
            "label": event.name,
            "start_s": start_s,
            "end_s": end_s,
            "duration_s": seconds,
            "warmup_call": warmup_call(warmup_rng, num_segments),
            # the question lists every class, names the call and states the clip's length
            PUBLIC_VALUES: [e.name for e in EVENTS] + ["submit_answer", seconds],
        }
        sample = Sample([{"role": "user", "content": content}], private=private, id=path.stem)
        lines.append(sample.to_json())
    file = out / f"{split}.jsonl"
    file.write_text("\n".join(lines) + "\n")
    return file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--num-train", type=int, default=96)
    parser.add_argument("--num-validation", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=5.0, help="clip length (whole seconds)")
    parser.add_argument("--fps", type=float, default=4.0)
    parser.add_argument("--size", type=int, default=64, help="frame width and height (even)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-urls", action="store_true", help="embed clips as data URLs")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.seconds < 2 or args.seconds != int(args.seconds):
        parser.error(f"--seconds must be a whole number >= 2, got {args.seconds}")
    if args.size % 2 or args.size < 16:
        parser.error(f"--size must be even and >= 16, got {args.size}")
    for split, count in (("train", args.num_train), ("validation", args.num_validation)):
        file = make_split(
            args.out,
            split,
            count,
            seed=args.seed,
            seconds=args.seconds,
            fps=args.fps,
            size=args.size,
            data_urls=args.data_urls,
            progress=not args.no_progress,
        )
        print(f"wrote {count} samples to {file}")


if __name__ == "__main__":
    main()
