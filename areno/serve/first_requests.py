"""A server's first request of each kind, sent by the Ingress itself before `/health` first
answers 200, so that no user's request pays for first use.

The Generator warms its engine and media towers at start-up (areno/processing/warmup.py), and the
Processor replica its native processor; what is left is first use along the request's way: the
Ingress's handles to each deployment (a handle learns its replicas on its first call), the
MediaDecoder's codecs and image plugins, the Processor's work on a request thread, the object
store's hand-over of a prompt's media tensors, and the streamed call. On the tiny Qwen3.5 on a
2-core CPU the first image request took 625 ms against a p50 of 91 and the first video 485
against 99 before these requests were sent (`benchmarks/serve_timeline.py`).

Each is a real request of one token, its media a small real file sent as a data URL (allowed
under every media policy), through the same calls a user's request makes.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from areno.media.samples import write_audio, write_image, write_video

# The file each modality's first request carries: (suffix, MIME type).
_FILES = {
    "image": (".png", "image/png"),
    "audio": (".wav", "audio/wav"),
    "video": (".mp4", "video/mp4"),
}


def first_messages(modalities: set[str] | frozenset[str]) -> dict[str, list[dict]]:
    """A one-message chat per kind: "text", and each of `modalities` with a small file of it."""
    chats = {"text": [{"role": "user", "content": "Say hello."}]}
    with tempfile.TemporaryDirectory(prefix="areno-first-") as root:
        for modality in sorted(modalities):
            suffix, mime = _FILES[modality]
            path = Path(root) / f"first{suffix}"
            if modality == "image":
                write_image(path, 224, 224)
            elif modality == "audio":
                write_audio(path, seconds=1.0)
            else:
                write_video(path, seconds=1.0, fps=4.0, width=224, height=224)
            url = f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()
            part = {"type": f"{modality}_url", f"{modality}_url": {"url": url}}
            content = [part, {"type": "text", "text": "Describe it."}]
            chats[modality] = [{"role": "user", "content": content}]
    return chats
