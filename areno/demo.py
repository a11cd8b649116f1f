"""The embedded demo: a processor round trip for an image, an audio clip and a video."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from areno.media.decoder import MediaDecoder
from areno.media.samples import write_audio, write_image, write_video
from areno.media.sources import MediaPolicy
from areno.models.tiny import tiny_checkpoint
from areno.processing import Processor, PromptInputs, process_messages


def _requests(media_dir: Path, modalities: frozenset[str]) -> list[tuple[str, list[dict]]]:
    image = write_image(media_dir / "scene.jpg", 320, 240)
    audio = write_audio(media_dir / "tone.wav", seconds=1.5, sampling_rate=44100)
    video = write_video(
        media_dir / "clip.mp4",
        seconds=2.0,
        fps=8.0,
        width=96,
        height=64,
        with_audio="audio" in modalities,
    )
    parts = {
        "image": {"type": "image_url", "image_url": {"url": str(image)}},
        "audio": {"type": "audio_url", "audio_url": {"url": str(audio)}},
        "video": {"type": "video_url", "video_url": {"url": str(video)}},
    }
    questions = {
        "image": "Describe this image.",
        "audio": "What is this sound?",
        "video": "What happens in this clip?",
    }
    return [
        (m, [{"role": "user", "content": [parts[m], {"type": "text", "text": questions[m]}]}])
        for m in ("image", "audio", "video")
        if m in modalities
    ]


def _report(name: str, inputs: PromptInputs, seconds: float, processor: Processor, logits) -> None:
    print(
        f"\n== {name}: {inputs.num_prompt_tokens} prompt tokens, decode+process {seconds * 1e3:.0f} ms"
    )
    for span in inputs.mm_spans:
        print(
            f"   {span.modality} #{span.index}: tokens [{span.start}, {span.end}), "
            f"{span.num_placeholder_tokens} placeholder tokens"
        )
    for key, value in inputs.mm_inputs.items():
        print(f"   {key}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}")
    tail = processor.tokenizer.decode(inputs.input_ids[-12:])
    print(f"   prompt ends: {tail!r}")
    print(f"   forward: logits {tuple(logits.shape)}, next token {int(logits[0, -1].argmax())}")


def run_processor_demo(model_path: str | None = None, *, family: str = "gemma4") -> None:
    """Decode real media files, run the native processor and a forward pass, print the result."""
    path = model_path or tiny_checkpoint(family)
    print(f"checkpoint: {path}")
    processor = Processor(path)
    adapter = processor.adapter
    print(
        f"family: {adapter.display_name} ({adapter.model_type}); accepts "
        f"{', '.join(sorted(adapter.modalities))}"
    )
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    model = adapter.load_model(path).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for name, messages in _requests(Path(tmp), adapter.modalities):
            start = time.perf_counter()
            inputs = process_messages(processor, decoder, messages)
            seconds = time.perf_counter() - start
            with torch.no_grad():
                logits = model(**inputs.model_inputs()).logits
            _report(name, inputs, seconds, processor, logits)
