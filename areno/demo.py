"""The main job on the embedded default: `areno serve` on the tiny Gemma 4 checkpoint, then a few
requests through the official `openai` client (image, audio, video, tools, streaming, n).

The terminal gets the demo's own lines only: each starts with "areno demo:", or belongs to an
answer block (a blank line, a "== " title, then lines indented by three spaces). Everything else
the process and the Ray processes it starts write (Ray's and Serve's logs, replicas' lines
streamed to the driver, library warnings, progress bars) goes to a log file, or with verbose to
the terminal."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from areno.media.samples import write_audio, write_image, write_video

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _media(media_dir: Path) -> dict[str, str]:
    return {
        "image": str(write_image(media_dir / "scene.jpg", 320, 240)),
        "audio": str(write_audio(media_dir / "tone.wav", seconds=1.5, sampling_rate=44100)),
        "video": str(
            write_video(media_dir / "clip.mp4", seconds=2.0, fps=8.0, width=96, height=64)
        ),
    }


def _part(modality: str, path: str) -> dict:
    return {"type": f"{modality}_url", f"{modality}_url": {"url": path}}


def _show(say: Callable[..., None], title: str, response, started: float) -> None:
    choice = response.choices[0]
    calls = [f"{c.function.name}({c.function.arguments})" for c in choice.message.tool_calls or []]
    say(f"\n== {title} ({(time.perf_counter() - started) * 1000:.0f} ms)")
    reasoning = getattr(choice.message, "reasoning_content", None)  # thinking templates only
    if reasoning:
        say(f"   reasoning: {reasoning!r}")
    say(f"   answer: {choice.message.content!r}  finish: {choice.finish_reason}")
    if calls:
        say(f"   tool calls: {calls}")
    usage = response.usage
    details = usage.prompt_tokens_details  # None when there are no media tokens to report
    media = f" (image {details.image_tokens}, audio {details.audio_tokens})" if details else ""
    say(f"   usage: prompt {usage.prompt_tokens}{media}, completion {usage.completion_tokens}")


def _ask_all(
    say: Callable[..., None],
    client,
    model: str,
    media: dict[str, str],
    modalities: frozenset[str],
) -> None:
    questions = {
        "image": "Describe this image.",
        "audio": "What is this sound?",
        "video": "What happens in this clip?",
    }
    for modality, question in questions.items():
        if modality not in modalities:
            continue
        started = time.perf_counter()
        content = [_part(modality, media[modality]), {"type": "text", "text": question}]
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=16
        )
        _show(say, f"{modality} request", response, started)
    started = time.perf_counter()
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=16,
    )
    _show(say, "tools request (a random tiny model rarely calls them)", response, started)
    say("\n== streaming video request, n=2")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [_part("video", media["video"])]}],
        max_tokens=16,
        n=2,
        stream=True,
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for index, text in texts.items():
        say(f"   sample {index}: {text!r}")


@contextlib.contextmanager
def _output_to(log_path: str) -> Iterator[Callable[..., None]]:
    """Point this process's stdout and stderr (the file descriptors: children inherit them, and
    C++ logs and library warnings write there too) at `log_path`; yield a print onto the
    terminal for the demo's own lines. Both come back on the way out, error or not."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = open(  # noqa: SIM115 -- closed on the way out
        os.dup(1), "w", encoding=sys.stdout.encoding, errors="backslashreplace"
    )
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield functools.partial(print, file=terminal, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal.close()


def run_demo(
    model_path: str | None = None, *, family: str | None = None, verbose: bool = False
) -> None:
    """Serve the checkpoint (default: the embedded tiny checkpoint of `family`, Gemma 4 unless
    given) on a free loopback port, query it with the openai client, print the answers, and shut
    everything down. Other output goes to a log file whose path is printed, unless `verbose`."""
    if verbose:
        _serve_and_ask(functools.partial(print, flush=True), model_path, family)
        return
    fd, log_path = tempfile.mkstemp(prefix="areno-demo-", suffix=".log")
    os.close(fd)
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # plain text in the log file
    with _output_to(log_path) as say:
        say(f"areno demo: Ray, Serve and library logs go to {log_path} (--verbose: here)")
        _serve_and_ask(say, model_path, family)


def _serve_and_ask(say: Callable[..., None], model_path: str | None, family: str | None) -> None:
    import openai
    import ray
    from ray import serve

    from areno.engine.config import EngineConfig
    from areno.models.registry import adapter_for_checkpoint
    from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint
    from areno.serve.app import run_server
    from areno.serve.config import ServeConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, loopback-only demo cluster
    path = model_path or str(tiny_checkpoint(family or DEFAULT_FAMILY))
    modalities = adapter_for_checkpoint(path).modalities
    config = ServeConfig(
        model_path=path,
        port=_free_port(),
        engine=EngineConfig(max_running_prompts=4, max_context_len=4096),
    )
    say(f"areno demo: starting the server for {path} (Ray + 4 Serve deployments)...")
    started = time.perf_counter()
    run_server(config, block=False, announce=lambda line: say(f"areno demo: {line}"))
    say(f"areno demo: server up in {time.perf_counter() - started:.1f} s")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none")
        model = client.models.list().data[0].id
        with tempfile.TemporaryDirectory(prefix="areno-demo-") as tmp:
            _ask_all(say, client, model, _media(Path(tmp)), modalities)
    finally:
        serve.shutdown()
        ray.shutdown()
    say("\nareno demo: done (the tiny checkpoint has random weights, so answers are noise).")
