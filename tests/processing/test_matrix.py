"""Every part type x source x modality through the native processor of every family.

Each case writes a real media file, references it the way a client or dataset would, runs the
shared processor path, checks the placeholder spans against the processor's media tensors and
runs the tiny model's forward on the result (Hugging Face checks features == placeholders there).
"""

from __future__ import annotations

import base64
import http.server
import mimetypes
import threading
from pathlib import Path

import pytest
import torch

from areno.media.decoder import MediaDecoder
from areno.media.samples import write_audio, write_image, write_video
from areno.media.sources import MediaPolicy
from areno.processing import Processor, process_messages

FORMATS = {"image": [".png", ".jpg"], "audio": [".wav", ".flac", ".mp3", ".ogg"], "video": [".mp4"]}
PART_TYPES = {
    "image": ["image_url", "image"],
    "audio": ["audio_url", "audio", "input_audio"],
    "video": ["video_url", "video"],
}
SOURCES = ["absolute", "relative", "file_url", "data_url", "http"]
FAMILY_MODALITIES = {
    "qwen3_5": ("image", "video"),
    "qwen3_vl": ("image", "video"),
    "minicpmv4_6": ("image", "video"),
    "gemma4": ("image", "audio", "video"),
}


def write_media(directory: Path, modality: str, suffix: str) -> Path:
    path = directory / f"{modality}{suffix}"
    if modality == "image":
        return write_image(path, 80, 60)
    if modality == "audio":
        return write_audio(path, seconds=1.2, sampling_rate=22050)
    return write_video(path, seconds=2.0, fps=4.0, width=64, height=48)


def reference(path: Path, source: str, cwd: Path, http_root: str) -> str:
    if source == "http":
        return f"{http_root}/{path.relative_to(cwd)}"
    if source == "absolute":
        return str(path)
    if source == "relative":
        return str(path.relative_to(cwd))
    if source == "file_url":
        return path.as_uri()
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def media_part(modality: str, part_type: str, ref: str, path: Path) -> dict:
    if part_type == "input_audio":
        data = base64.b64encode(path.read_bytes()).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": path.suffix[1:]}}
    if part_type.endswith("_url"):
        return {"type": part_type, part_type: {"url": ref}}
    return {"type": part_type, "url": ref}


def cases():
    for family, modalities in FAMILY_MODALITIES.items():
        for modality in modalities:
            for part_type in PART_TYPES[modality]:
                sources = ["data_url"] if part_type == "input_audio" else SOURCES
                for source in sources:
                    for suffix in FORMATS[modality]:
                        yield pytest.param(
                            family,
                            modality,
                            part_type,
                            source,
                            suffix,
                            id=f"{family}-{part_type}-{source}-{suffix[1:]}",
                        )


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def translate_path(self, path):
        # Serve from the test's working directory (each test chdirs into its tmp_path).
        return str(Path.cwd() / path.lstrip("/").split("?")[0])


@pytest.fixture(scope="module")
def http_root():
    """A real HTTP server on loopback serving the current test's files."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def workers(tiny_path):
    cache = {}

    def get(family: str):
        if family not in cache:
            processor = Processor(tiny_path(family))
            # Remote media on, loopback allowed: the test's HTTP server lives on 127.0.0.1.
            policy = MediaPolicy.for_training(allow_remote=True, allow_private_network=True)
            decoder = MediaDecoder(policy, processor.decode_options())
            model = processor.adapter.load_model(tiny_path(family)).eval()
            cache[family] = (processor, decoder, model)
        return cache[family]

    return get


@pytest.mark.parametrize("family,modality,part_type,source,suffix", list(cases()))
def test_part_through_processor_and_forward(
    workers, http_root, tmp_path, monkeypatch, family, modality, part_type, source, suffix
):
    monkeypatch.chdir(tmp_path)
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    path = write_media(media_dir, modality, suffix)
    ref = reference(path, source, tmp_path, http_root)
    messages = [
        {
            "role": "user",
            "content": [
                media_part(modality, part_type, ref, path),
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    processor, decoder, model = workers(family)
    inputs = process_messages(processor, decoder, messages)

    [span] = inputs.mm_spans
    assert span.modality == modality and span.num_placeholder_tokens > 0
    token_id = getattr(processor.hf_processor, f"{modality}_token_id")
    # Every placeholder token of the prompt lies inside the item's span.
    assert inputs.input_ids.count(token_id) == span.num_placeholder_tokens
    assert inputs.input_ids[span.start : span.end].count(token_id) == span.num_placeholder_tokens
    with torch.no_grad():
        logits = model(**inputs.model_inputs()).logits
    assert logits.shape[1] == inputs.num_prompt_tokens
    assert torch.isfinite(logits).all()
