"""The agent loop on a real tiny checkpoint: tool calls parsed with the serving parser, a tool
that returns an image, token-in / token-out across turns, and the loss mask.

The random tiny model is first taught (by `areno.train.sft`, a few seconds) to answer with a
`zoom` call, so the loop has real calls to run without scripting the engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from PIL import Image

from areno.data import Sample
from areno.engine.config import EngineConfig
from areno.engine.sampling import SamplingParams
from areno.rollout import Agent, ToolContext
from areno.rollout.worker import RolloutSpec, RolloutWorker
from areno.train.policy import load_policy, sequence_logprobs
from areno.train.sft import SFTConfig, sft

CALL = (
    "<tool_call>\n<function=zoom>\n<parameter=factor>\n2\n</parameter>\n</function>\n</tool_call>"
)
ZOOM_SCHEMA = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Crop the center of the image and enlarge it.",
        "parameters": {
            "type": "object",
            "properties": {"factor": {"type": "integer"}},
            "required": ["factor"],
        },
    },
}


def _zoom(arguments: dict, ctx: ToolContext) -> list[dict]:
    source = Path(ctx.media_urls("image")[0])
    factor = int(arguments["factor"])
    with Image.open(source) as image:
        w, h = image.size
        box = (w // 4, h // 4, w - w // 4, h - h // 4)
        crop = image.crop(box).resize((w * factor // 2, h * factor // 2))
    out = source.with_name(f"{source.stem}-zoom{factor}-{ctx.episode_index}.png")
    crop.save(out)
    return [
        {"type": "text", "text": f"zoomed x{factor}"},
        {"type": "image_url", "image_url": {"url": str(out)}},
    ]


def zoom_agent(max_turns: int = 3) -> Agent:
    return Agent(
        tools={"zoom": _zoom},
        tool_schemas=[ZOOM_SCHEMA],
        system_prompt="Use the zoom tool to look closer.",
        max_turns=max_turns,
    )


def _messages(path: Path) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": str(path)}},
                {"type": "text", "text": "What is in the middle?"},
            ],
        }
    ]


def zoom_samples(media_dir: str, num_samples: int = 4):
    """Samples whose private `target` is the zoom call (for the supervised warm-start)."""
    for index in range(num_samples):
        path = Path(media_dir) / f"scene-{index}.png"
        Image.new("RGB", (64, 48), (40 * index, 120, 200)).save(path)
        messages = zoom_agent().prompt_messages(_messages(path))
        yield Sample(messages, [ZOOM_SCHEMA], {"target": CALL}, id=f"scene-{index}")


@pytest.fixture(scope="module")
def caller(tiny_path, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3.5 checkpoint that answers with the zoom call, and the media directory."""
    media = tmp_path_factory.mktemp("media")
    out = tmp_path_factory.mktemp("caller") / "ckpt"
    config = SFTConfig(
        model_path=str(tiny_path("qwen3_5")),
        out_dir=str(out),
        loader="tests.rollout.test_episode:zoom_samples",
        loader_kwargs={"media_dir": str(media)},
        target_key="target",
        steps=40,
        batch_size=4,
        lr=3e-3,
    )
    return sft(config, log=lambda _: None), media


@pytest.fixture(scope="module")
def worker(caller):
    checkpoint, _ = caller
    spec = RolloutSpec(
        str(checkpoint),
        EngineConfig(max_running_prompts=4, max_context_len=1024),
        agent="tests.rollout.test_episode:zoom_agent",
        agent_kwargs={"max_turns": 2},
        max_tokens_per_turn=64,
    )
    worker = RolloutWorker(spec)
    yield worker
    worker.shutdown()


def _run(worker, media: Path, group_size: int = 2, sampling: SamplingParams | None = None):
    path = media / "scene-1.png"
    sampling = sampling or SamplingParams(temperature=0)
    return asyncio.run(worker.run_group("scene-1", _messages(path), group_size, sampling))


def test_tool_calls_run_and_their_media_reach_the_next_turn(worker, caller):
    result = _run(worker, caller[1])
    trajectories, timings = result.trajectories, result.timings
    assert result.skipped is None
    assert len(trajectories) == 2 and timings["generate_s"] > 0
    traj = trajectories[0]
    # turn 1 calls zoom; its result (text + a zoomed image) is appended and turn 2 generated;
    # what turn 2 says (a call at the turn limit, or text) ends the episode either way
    assert traj.num_turns == 2 and traj.finish in ("max_turns", "answer")
    first = traj.tool_calls[0]
    assert (first.turn, first.name, first.arguments) == (0, "zoom", '{"factor": 2}')
    assert first.num_media == 1 and first.result_text == "zoomed x2"
    assert [s.modality for s in traj.inputs.mm_spans] == ["image", "image"]
    assert traj.inputs.mm_inputs["image_grid_thw"].shape[0] == 2
    assert traj.policy_versions == [0, 0]
    assert trajectories[1].token_ids == traj.token_ids  # greedy: the group's episodes agree


def test_a_group_whose_sample_media_fails_is_skipped_with_the_reason(worker, caller):
    """A sample's own bad content skips its group, the error naming the cause: an image its
    prompt names that is not there, or one a tool returns that is not there (the episodes that
    ran are dropped with it). The worker runs the next group as before."""
    missing = caller[1] / "not-there.png"
    sampling = SamplingParams(temperature=0)
    result = asyncio.run(worker.run_group("scene-x", _messages(missing), 2, sampling))
    assert result.trajectories == [] and result.skipped.startswith("MediaNotFoundError: ")
    assert str(missing) in result.skipped

    gone = caller[1] / "zoom-gone.png"

    def zoom_to_nothing(arguments: dict, ctx: ToolContext) -> list[dict]:
        return [{"type": "image_url", "image_url": {"url": str(gone)}}]

    agent = worker.agent
    worker.agent = Agent(
        tools={"zoom": zoom_to_nothing}, tool_schemas=[ZOOM_SCHEMA], max_turns=2,
        system_prompt="Use the zoom tool to look closer.",
    )  # fmt: skip
    try:
        result = _run(worker, caller[1])
    finally:
        worker.agent = agent
    assert result.trajectories == [] and result.skipped.startswith("MediaNotFoundError: ")
    assert str(gone) in result.skipped
    assert len(_run(worker, caller[1]).trajectories) == 2


def test_loss_mask_covers_exactly_the_sampled_tokens(worker, caller):
    traj = _run(worker, caller[1], group_size=1).trajectories[0]
    n = traj.num_prompt_tokens
    assert traj.loss_mask[:n] == [0] * n
    # each turn's sampled tokens are a run of 1s ending in the end-of-turn token; tool results
    # (and nothing else) are the 0 runs in between
    runs, current = [], None
    for bit in traj.loss_mask[n:]:
        if current is None or bit != current[0]:
            current = [bit, 0]
            runs.append(current)
        current[1] += 1
    assert [bit for bit, _ in runs] == [1, 0, 1]
    eot = worker.env.end_of_turn_id
    ones = [i for i, bit in enumerate(traj.loss_mask) if bit]
    assert sum(traj.loss_mask) == traj.num_generated_tokens == len(ones)
    assert traj.token_ids[ones[-1]] == eot
    masked_lp = [lp for lp, bit in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if bit]
    assert all(lp <= 0.0 for lp in masked_lp) and any(lp < 0.0 for lp in masked_lp)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_trainer_scores_the_exact_episode_the_generator_sampled(worker, caller, temperature):
    """Token-in / token-out with media: one forward over the whole multi-turn episode gives the
    generator's per-token logprobs (fp32 CPU), so nothing was re-templated or re-encoded. Sampled
    at 0.5, both sides describe the tempered distribution the tokens were drawn from."""
    sampling = SamplingParams(temperature=temperature, seed=11)
    traj = _run(worker, caller[1], group_size=1, sampling=sampling).trajectories[0]
    model, _, _ = load_policy(caller[0], dtype=torch.float32)
    model.eval()
    start = traj.num_prompt_tokens
    with torch.no_grad():
        train_lp = sequence_logprobs(model, traj.inputs, "cpu", start, temperature)
    mask = torch.tensor(traj.loss_mask[start:], dtype=torch.bool)
    rollout_lp = torch.tensor(traj.rollout_logprobs[start:])
    diff = (train_lp - rollout_lp)[mask].abs()
    assert diff.numel() == traj.num_generated_tokens
    assert diff.max().item() < 1e-4, diff.max().item()


@pytest.mark.parametrize("family, thinks", [("qwen3_5", True), ("qwen3_vl", False)])
def test_only_the_reply_after_the_reasoning_block_is_parsed(tiny_path, family, thinks):
    from areno.processing import Processor
    from areno.rollout.episode import reply_text

    processor = Processor(tiny_path(family))
    prompt = processor.encode([{"role": "user", "content": "Hi"}], [])
    text = "Let me look.\n</think>\n\n" + CALL
    assert reply_text(processor.tokenizer, prompt.input_ids, text) == (CALL if thinks else text)
    # A block never closed leaves the whole text to parse.
    assert reply_text(processor.tokenizer, prompt.input_ids, CALL) == CALL
