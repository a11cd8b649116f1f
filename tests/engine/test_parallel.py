"""Tensor parallelism on CPU over gloo: two ranks, each running a ModelRunner over its shard of a
tiny checkpoint, give the same greedy tokens and logits as one process with the whole model."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig

from areno.engine.parallel import tensor_parallel
from areno.engine.runner.model_runner import ModelRunner
from areno.errors import ConfigError
from areno.media import MediaDecoder, MediaPolicy
from areno.media.samples import write_image
from areno.models import get_adapter
from areno.processing import Processor, process_messages

TP_FAMILIES = ["qwen3_5", "minicpmv4_6", "gemma4"]
WORLD_SIZE = 2
NUM_STEPS = 5
TIMEOUT_S = 180
CONTROL_MESSAGE = {"step": 3, "slots": [2, 0], "tokens": [11, 7], "prefill": None}


def messages(image: str, text: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def run_requests(model_path: str, image: str, *, tp_size: int) -> dict:
    """Two staggered image+text requests in slots 2 and 0: prefill A, decode A, prefill B, then
    batched decode of both. Returns each request's greedy tokens and every step's logits."""
    processor = Processor(model_path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    model = tensor_parallel.load_model_for_rank(
        processor.adapter, model_path, tp_size=tp_size, dtype=torch.float32, device="cpu"
    )
    inputs = [
        process_messages(processor, decoder, messages(image, "Describe the picture.")),
        process_messages(processor, decoder, messages(image, "What colour is it?")),
    ]
    runner = ModelRunner(model, num_slots=4, max_len=256)
    slots, tokens, logits = [2, 0], [[], []], []

    def record(row: int, logits_V: torch.Tensor) -> None:
        logits.append(logits_V)
        tokens[row].append(int(logits_V.argmax()))

    def decode(rows: list[int]) -> None:
        positions = [inputs[r].num_prompt_tokens + len(tokens[r]) - 1 for r in rows]
        out = runner.decode([slots[r] for r in rows], positions, [tokens[r][-1] for r in rows])
        for i, r in enumerate(rows):
            record(r, out[i])

    record(0, runner.prefill(inputs[0], [slots[0]]))
    decode([0])
    record(1, runner.prefill(inputs[1], [slots[1]]))
    for _ in range(NUM_STEPS):
        decode([0, 1])
    sharded = sum(isinstance(p, dist.tensor.DTensor) for p in model.parameters())
    return {"tokens": tokens, "logits": torch.stack(logits), "num_sharded": sharded}


def tp_worker(rank: int, port: int, cases: dict[str, str], image: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    tensor_parallel.init_distributed(rank, WORLD_SIZE, "127.0.0.1", port, "cpu")
    try:
        message = [CONTROL_MESSAGE if rank == 0 else None]
        dist.broadcast_object_list(message, src=0, group=tensor_parallel.control_group())
        results = {"control": message[0]}
        for family, path in cases.items():
            results[family] = run_requests(path, image, tp_size=WORLD_SIZE)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        tensor_parallel.shutdown_distributed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, args: tuple) -> None:
    """Run fn(rank, *args) in WORLD_SIZE spawned processes; re-raise a rank's failure; never
    leave a process behind (a hung collective is killed after TIMEOUT_S)."""
    context = mp.start_processes(fn, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join()


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    return str(write_image(tmp_path_factory.mktemp("tp-media") / "a.png", 64, 48))


@pytest.fixture(scope="module")
def tp_results(tiny_path, image, tmp_path_factory) -> list[dict]:
    """Both ranks' results, from one spawn that loads every family once."""
    out_dir = tmp_path_factory.mktemp("tp-out")
    cases = {family: str(tiny_path(family)) for family in TP_FAMILIES}
    spawn_ranks(tp_worker, (free_port(), cases, image, str(out_dir)))
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def test_control_group_carries_a_dict_from_rank_0(tp_results):
    assert [r["control"] for r in tp_results] == [CONTROL_MESSAGE] * WORLD_SIZE


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_runner_equals_single_process(tiny_path, image, tp_results, family):
    expected = run_requests(str(tiny_path(family)), image, tp_size=1)
    for got in tp_results:
        assert got[family]["num_sharded"] > 0
        assert got[family]["tokens"] == expected["tokens"]
        diff = (got[family]["logits"] - expected["logits"]).abs().max().item()
        assert diff < 1e-4, diff


@pytest.mark.parametrize(
    ("family", "tp_size", "plan"),
    [
        ("qwen3_5", 1, None),
        ("qwen3_5", 2, "auto"),
        ("minicpmv4_6", 2, "auto"),
        ("gemma4", 2, get_adapter("gemma4").tp_plan_overrides),
    ],
)
def test_tp_plan_for(family, tp_size, plan):
    assert tensor_parallel.tp_plan_for(get_adapter(family), tp_size) == plan


def test_head_counts_must_divide_by_tp_size(tiny_path):
    # Colwise q/k/v shards split heads * head_dim evenly: 1 KV head over 2 ranks would leave
    # each rank half a head and fail mid-forward, so loading refuses it up front.
    config = AutoConfig.from_pretrained(tiny_path("qwen3_5"))
    tensor_parallel.check_head_counts(config, 2)
    config.text_config.num_key_value_heads = 1
    with pytest.raises(ConfigError, match="num_key_value_heads=1"):
        tensor_parallel.check_head_counts(config, 2)
    gemma = AutoConfig.from_pretrained(tiny_path("gemma4"))
    with pytest.raises(ConfigError, match="Gemma4TextConfig"):
        tensor_parallel.check_head_counts(gemma, 4)


def test_qwen3_vl_refuses_tensor_parallelism():
    with pytest.raises(ConfigError, match="qwen3_vl .* no tensor-parallel plan.*--tp-size 1"):
        tensor_parallel.tp_plan_for(get_adapter("qwen3_vl"), 2)
    with pytest.raises(ConfigError, match="qwen3_vl"):
        tensor_parallel.load_model_for_rank(
            get_adapter("qwen3_vl"), "unused", tp_size=2, dtype=torch.float32, device="cpu"
        )
