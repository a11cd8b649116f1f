"""The live Gemma 4 server that every module of this folder drives with the official `openai`
client over loopback HTTP, and what its tests share: media files and a loopback HTTP server over
them, a LoRA adapter served beside the base model, the tokenizer. Two apps, deployed once for the
folder into the Ray instance of tests/serve/live: the open one at `/` (every media source, remote
media from private addresses, the adapter) and a guarded one at `/guarded` (an API key, one
allowed media root, no remote media, a one-request waiting queue)."""

from __future__ import annotations

import dataclasses
import http.server
import threading
from collections.abc import Iterator

import openai
import pytest
import torch

from areno.engine.config import EngineConfig
from areno.media.samples import write_audio, write_image, write_video
from areno.serve.app import APP_NAME
from areno.serve.config import ServeConfig
from tests.serve.live.apps import deployed
from tests.serve.live.openai_server.client import API_KEY, GUARDED_MAX_QUEUED, MAX_PROMPT_TOKENS


@pytest.fixture(scope="package")
def media_root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-media")


@pytest.fixture(scope="package")
def lora(tiny_path, tmp_path_factory):
    """A PEFT adapter on the tiny Gemma 4 with random factors (large enough to change its
    greedy tokens), and the merged model: base weights plus the adapter's, as peft merges them."""
    from areno.models.registry import adapter_for_checkpoint
    from areno.train.lora import LoraConfig, apply_lora, export_adapter

    path = tiny_path("gemma4")
    torch.manual_seed(0)
    model = apply_lora(adapter_for_checkpoint(path).load_model(path), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.3)
    directory = export_adapter(model, path, tmp_path_factory.mktemp("lora") / "tiny-lora")
    return directory, model.merge_and_unload().eval()


@pytest.fixture(scope="package")
def server(serve_port, tiny_path, media_root, lora) -> Iterator[openai.OpenAI]:
    """A client of the open app; `client.guarded_client` reaches the guarded one."""
    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        served_model_name="tiny-gemma4",
        port=serve_port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=2048),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        allow_remote_media=True,
        allow_private_network_media=True,  # the test's HTTP server is on loopback
        lora_adapters={"tiny-lora": str(lora[0])},
    )
    # An API key, one allowed media root, remote media at its default (off), a one-request
    # waiting queue.
    guarded = dataclasses.replace(
        config,
        lora_adapters={},
        api_key=API_KEY,
        allowed_local_media_paths=(str(media_root),),
        max_queued_requests=GUARDED_MAX_QUEUED,
        # AReno's own request router, under the refusals and cancellations of the queue
        # tests (a batch's prompts cancelled while queued in it once left later requests
        # unrouted); the open app keeps Serve's.
        routing="prefix",
    )
    guarded = dataclasses.replace(
        guarded, allow_remote_media=False, allow_private_network_media=False
    )
    with deployed((APP_NAME, "/", config), ("guarded", "/guarded", guarded)):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused")


@pytest.fixture(scope="package")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-media")
    return {
        "image": str(write_image(d / "a.png", 64, 48)),
        "audio": str(write_audio(d / "a.wav", seconds=1.0)),
        "video": str(write_video(d / "v.mp4", seconds=2.0, fps=4.0)),
        "dir": d,
    }


@pytest.fixture(scope="package")
def http_media(media):
    """A loopback HTTP server over the test's media directory."""
    directory = str(media["dir"])

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=directory, **kwargs)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="package")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path("gemma4"))
