"""Batched trainer passes: the plan (which trajectories share a forward, the same number of
passes on every rank; a GRPO group's episodes packed into one row) and the one thing that
matters about them, that the gradient of a batched mini-batch equals the
one-trajectory-per-pass gradient (fp32, the trainer's own `Learner` under DeepSpeed, every
family, trajectories with images, video and audio, groups whose episodes share their prompt and
carry media of their own after it)."""

from __future__ import annotations

import random

import pytest
import torch

from areno.media.decoder import MediaDecoder
from areno.media.samples import write_audio, write_image, write_video
from areno.media.sources import MediaPolicy
from areno.models.tiny import TINY_FAMILIES
from areno.processing.processor import Processor
from areno.processing.types import MediaSpan, PromptInputs
from areno.rollout.trajectory import Trajectory
from areno.train.batching import (
    collate,
    plan_micro_batches,
    plan_rows,
    plan_step,
    split_rows_to,
)
from areno.train.config import GRPOConfig
from areno.train.packing import row_length, shared_length


def _prompt(n: int, **mm: torch.Tensor) -> PromptInputs:
    return PromptInputs(list(range(1, n + 1)), dict(mm))


def test_micro_batches_fill_the_token_budget_longest_first() -> None:
    items = [_prompt(n) for n in (10, 40, 30, 12, 11)]
    # rows x longest row <= 60, longest first, first fit: [40], [30, 12], [11, 10]
    assert plan_micro_batches(items, 60) == [[1], [2, 3], [4, 0]]
    assert plan_micro_batches(items, 80) == [[1, 2], [3, 4, 0]]
    assert plan_micro_batches(items, 0) == [[1], [2], [3], [4], [0]]
    # a trajectory longer than the budget runs alone
    assert plan_micro_batches([_prompt(100), _prompt(5)], 50) == [[0], [1]]


def test_media_share_a_pass_within_their_group_when_their_tensors_line_up() -> None:
    def clip(frames: int, group: str) -> PromptInputs:
        prompt = _prompt(10, audio=torch.zeros(1, frames, 8))
        prompt.mm_spans.append(MediaSpan("audio", 0, 1, 9, 8, f"hash-{group}"))
        return prompt

    items = [clip(99, "a"), clip(50, "a"), clip(99, "a"), clip(99, "b"), _prompt(8), _prompt(7)]
    groups = ["a", "a", "a", "b", "c", "d"]
    # 0 and 2 line up; 1's clip does not; 3 is another group's; text-only rows share freely
    assert plan_micro_batches(items, 1000, groups=groups) == [[0, 2], [1], [3], [4, 5]]
    # by default the group is the media itself
    assert plan_micro_batches(items, 1000) == [[0, 2], [1], [3], [4, 5]]
    # a family whose forward takes one prompt's media at a time
    unbatched = plan_micro_batches(items, 1000, groups=groups, batched_media=False)
    assert unbatched == [[0], [1], [2], [3], [4, 5]]


def test_a_group_shares_its_prompt_up_to_its_first_differing_token_or_media_item() -> None:
    def episode(ids: list[int], *spans: tuple[int, int, str]) -> PromptInputs:
        item = PromptInputs(ids, {})
        item.mm_spans.extend(
            MediaSpan("image", i, a, b, b - a, h) for i, (a, b, h) in enumerate(spans)
        )
        return item

    a = episode([1, 2, 3, 4, 5, 6, 7], (1, 3, "x"))
    b = episode([1, 2, 3, 4, 9], (1, 3, "x"))
    assert shared_length([a, b]) == 4 and row_length([a, b]) == 4 + 3 + 1
    # the same tokens around another image: the row shares only what is before it
    assert shared_length([a, episode([1, 2, 3, 4, 9], (1, 3, "y"))]) == 1
    # an item the shared tokens would cut in two stays whole in each episode's rest
    assert (
        shared_length([episode([1, 2, 3, 4], (2, 4, "x")), episode([1, 2, 3, 5], (2, 4, "z"))]) == 2
    )
    assert shared_length([a]) == 7


def test_packed_rows_hold_a_group_each_and_fill_the_budget() -> None:
    # two groups of three sharing a 50-token prompt, rests of 10 tokens; two loners
    prompt = list(range(1, 51))
    items = [PromptInputs(prompt + [100 + i] * 10, {}) for i in range(6)] + [
        _prompt(30),
        _prompt(20),
    ]
    keys = ["a", "a", "a", "b", "b", "b", None, None]
    assert row_length(items[:3]) == 50 + 3 * 10
    assert plan_rows(items, 160, keys) == [[[0, 1, 2], [3, 4, 5]], [[6], [7]]]
    # a group longer than the budget halves until its rows fit
    assert plan_rows(items, 70, keys) == [[[1, 2]], [[4, 5]], [[0]], [[3]], [[6], [7]]]
    assert plan_rows(items, 0, keys) == [[[i]] for i in (0, 1, 2, 3, 4, 5, 6, 7)]
    # more passes for a rank that has fewer: rows split, then a lone row's members
    split = split_rows_to([[[0, 1, 2], [3, 4, 5]]], 3)
    assert split == [[[0]], [[1, 2]], [[3, 4, 5]]]


def test_collate_pads_rows_and_concatenates_media() -> None:
    a = _prompt(3, pixel_values=torch.ones(4, 2), mm_token_type_ids=torch.ones(1, 3).long())
    b = _prompt(5, pixel_values=torch.full((2, 2), 2.0))
    batch = collate([a, b])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["mm_token_type_ids"].tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert batch["pixel_values"].shape == (6, 2) and batch["pixel_values"][4:].eq(2).all()


def test_every_rank_runs_as_many_passes_per_mini_batch() -> None:
    split = split_rows_to([[[0], [1], [2], [3]], [[4]]], 4)
    assert sorted(i for b in split for r in b for i in r) == [0, 1, 2, 3, 4] and len(split) == 4

    lengths = [100, 10, 10, 10, 10, 10, 10, 10]  # rank 0 gets the long one
    pairs = [(_Traj(_prompt(n), 1), 0.5) for n in lengths]
    shares = plan_step(pairs, world_size=2, mini_batches=2, budget=64)
    for m in range(2):
        counts = [len(shares[r][m].micro) for r in range(2)]
        assert counts[0] == counts[1], counts
        assert all(shares[r][m].episodes == 4 for r in range(2))
    # mini-batch 0 is the first half of the pairs: ranks 0 and 1 take two each
    assert [t.inputs.num_prompt_tokens for t, _ in sum(shares[0][0].micro, [])] == [100, 10]


def _trained(shares) -> list:
    """The pairs a plan trains (fillers left out), in plan order."""
    return [
        pair
        for share in shares
        for mini in share
        for index, micro in enumerate(mini.micro)
        if not mini.is_filler(index)
        for pair in micro
    ]


@pytest.mark.parametrize("packs", [False, True])
@pytest.mark.parametrize(
    ("num_pairs", "world_size", "mini_batches"),
    [(18, 1, 4), (18, 2, 4), (23, 2, 4), (3, 2, 2), (1, 2, 4), (5, 4, 1)],
)
def test_every_kept_trajectory_is_trained_once_however_many_a_step_kept(
    num_pairs, world_size, mini_batches, packs
) -> None:
    """Skipped samples shrink a step's batch below what the config divides evenly (6 x 4
    episodes, one sample of 6 skipped: 18); every pair still trains exactly once, every rank
    runs as many passes per mini-batch, a rank short of pairs runs fillers, and the loss
    normalisers count the real pairs only."""
    pairs = [(_Traj(_prompt(10 + i % 3), 2, sample_id=f"s{i // 6}"), 0.5) for i in range(num_pairs)]
    shares = plan_step(pairs, world_size, mini_batches, budget=64, packs=packs)
    trained = _trained(shares)
    assert sorted(id(p) for p in trained) == sorted(id(p) for p in pairs)
    num_minis = {len(share) for share in shares}
    assert num_minis == {min(mini_batches, num_pairs)}
    for m in range(min(mini_batches, num_pairs)):
        minis = [share[m] for share in shares]
        assert len({len(mini.micro) for mini in minis}) == 1
        real = [p for mini in minis for i, mc in enumerate(mini.micro) if not mini.is_filler(i)
                for p in mc]  # fmt: skip
        assert all(mini.episodes == len(real) and mini.tokens == 2 * len(real) for mini in minis)
        if packs:
            assert all(sum(map(sum, mini.rows)) == sum(map(len, mini.micro)) for mini in minis)


def test_the_parts_of_split_program_episodes_pack_by_part() -> None:
    """An agent program's episodes split in two: a group's first parts share one prompt, its
    second parts another; each packs into a row of its own, sharing its prompt."""
    first, second = list(range(1, 51)), list(range(200, 240))
    pairs = [
        (_Traj(PromptInputs(prompt + [100 + e] * 5, {}), 5, sample_id="s", part=part), 0.5)
        for e in range(3)
        for part, prompt in enumerate((first, second))
    ]
    [[mini]] = plan_step(pairs, world_size=1, mini_batches=1, budget=4096, packs=True)
    [micro], [lengths] = mini.micro, mini.rows
    rows = [micro[sum(lengths[:r]) : sum(lengths[: r + 1])] for r in range(len(lengths))]
    assert sorted(sorted(t.part for t, _ in row) for row in rows) == [[0, 0, 0], [1, 1, 1]]
    assert sorted(shared_length([t.inputs for t, _ in row]) for row in rows) == [40, 50]


class _Traj:
    def __init__(
        self, inputs: PromptInputs, generated: int, sample_id: str | None = None, part: int = 0
    ):
        self.inputs, self.num_generated_tokens, self.sample_id = inputs, generated, sample_id
        self.part = part


# --- the gradient of a batched mini-batch -------------------------------------------------


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_media")
    return {
        "a": write_image(root / "a.png", 64, 48),
        "b": write_image(root / "b.png", 80, 40, seed=3),
        "video": write_video(root / "v.mp4"),
        "audio": write_audio(root / "s.wav", seconds=1.0),
    }


def _trajectories(path, media) -> list[Trajectory]:
    """Eight single-turn trajectories of mixed media and lengths, each with a made-up reply
    (the loss only needs tokens, a mask and behaviour logprobs); pairs of a sample id, whose
    prompts share their first tokens, and two without one."""
    processor = Processor(path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    part = {
        "a": {"type": "image_url", "image_url": {"url": str(media["a"])}},
        "b": {"type": "image_url", "image_url": {"url": str(media["b"])}},
        "video": {"type": "video_url", "video_url": {"url": str(media["video"])}},
        "audio": {"type": "audio_url", "audio_url": {"url": str(media["audio"])}},
    }
    kinds = [["a"], ["a"], ["b", "video"], [], ["a"], [], ["b"], ["audio"]]
    rng = random.Random(7)
    out = []
    for index, kind in enumerate(kinds):
        if kind == ["audio"] and "audio" not in processor.adapter.modalities:
            kind = ["a"]
        content = [part[k] for k in kind] + [{"type": "text", "text": "look " * (index + 1)}]
        messages = [{"role": "user", "content": content}]
        prompt = processor.encode(messages, decoder.decode_many(processor.media_refs(messages)))
        n = prompt.num_prompt_tokens
        words = " ".join(rng.choice(("red", "blue", "cat", "sky", "ten")) for _ in range(index))
        reply = processor.tokenizer.encode(f"The answer is {words}.", add_special_tokens=False)
        mask = [1] * len(reply)
        mask[1] = 0  # a token the policy did not sample (a tool's, say) inside the reply
        logprobs = [-rng.uniform(1.0, 6.0) * m for m in mask]
        out.append(
            Trajectory(
                f"s{index // 2}" if index < 6 else None,  # the last two: rows of their own
                index % 2,
                prompt.with_tokens(prompt.input_ids + reply),
                n,
                [0] * n + mask,
                [0.0] * n + logprobs,
                [0],
                token_versions=[0] * sum(mask),
            )
        )
    return out


def _group_trajectories(path, media, rest_image: bool = True) -> list[Trajectory]:
    """Two GRPO groups of four episodes: each group's episodes share its prompt (media and a
    question) and part at their replies; two go on for a second turn, one of them with an
    image of its own (a tool result's, say) where `rest_image`."""
    processor = Processor(path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    image = {"type": "image_url", "image_url": {"url": str(media["a"])}}
    other = {"type": "image_url", "image_url": {"url": str(media["b"])}}
    video = {"type": "video_url", "video_url": {"url": str(media["video"])}}
    audio = {"type": "audio_url", "audio_url": {"url": str(media["audio"])}}
    sound = [audio] if "audio" in processor.adapter.modalities else []

    def encode(messages):
        return processor.encode(messages, decoder.decode_many(processor.media_refs(messages)))

    rng = random.Random(11)
    out = []
    for group, first in enumerate(([image, *sound], [video])):
        user = {"role": "user", "content": [*first, {"type": "text", "text": "what is it?"}]}
        n = encode([user]).num_prompt_tokens
        for episode in range(4):
            words = " ".join(rng.choice(("red", "blue", "cat", "sky")) for _ in range(episode + 1))
            messages = [user, {"role": "assistant", "content": f"It is {words}."}]
            if episode in (1, 2):
                content = [other] if episode == 1 and rest_image else []
                content.append({"type": "text", "text": "and now?"})
                messages += [{"role": "user", "content": content}]
                messages += [{"role": "assistant", "content": f"Still {words}."}]
            inputs = encode(messages)
            mask = [0] * n + [1] * (inputs.num_prompt_tokens - n)
            logprobs = [-rng.uniform(1.0, 6.0) * m for m in mask]
            versions = [0] * sum(mask)
            out.append(
                Trajectory(
                    f"g{group}", episode, inputs, n, mask, logprobs, [0], token_versions=versions
                )
            )
    return out


def _learner(path, zero_stage: int, budget: int, loss: dict, **grpo):
    from areno.train.learner import Learner

    config = GRPOConfig.from_dict(
        {
            "model_path": str(path),
            "grpo": {"group_size": 2, "prompts_per_step": 4, "loss": loss, **grpo},
            "trainer": {"zero_stage": zero_stage, "micro_batch_tokens": budget},
            "optim": {"lr": 1e-3},
        }
    )
    torch.manual_seed(0)
    return Learner(config, str(path), 0, 1)


def _gradient(
    path, trajs, budget: int, loss: dict, packed: list | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """The gradient of one mini-batch of `trajs` (ZeRO-0: whole on the parameters) and the
    number of passes it took; the ratio is taken against the trainer's own logprobs, so that
    no token is clipped out of the comparison."""
    from areno.train.learner import SUM_KEYS

    learner = _learner(path, 0, budget, loss, behaviour_logprobs="recompute")
    try:
        pairs = list(zip(trajs, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.5], strict=True))
        packs = learner.layout is not None
        ((mini,),) = plan_step(
            pairs, 1, 1, budget, batched_media=learner.adapter.batched_media, packs=packs
        )
        if packed is not None:
            packed.append(mini.rows)
        learner.module.train()
        learner.accumulate(mini, dict.fromkeys(SUM_KEYS, 0.0))
        grads = {
            name: p.grad.detach().clone()
            for name, p in learner.module.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        return grads, len(mini.micro)
    finally:
        learner.deepspeed.destroy()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_batched_passes_give_the_unbatched_gradient(process_group, tiny_path, media, family):
    path = tiny_path(family)
    trajs = _trajectories(path, media)
    # the second with a KL term: the reference model's passes are batched too
    for loss in ({"loss_agg": "token_mean"}, {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1}):
        alone, passes_alone = _gradient(path, trajs, 0, loss)
        batched, passes = _gradient(path, trajs, 1 << 16, loss)
        assert passes_alone == len(trajs) and passes < passes_alone, (family, passes)
        assert alone.keys() == batched.keys() and alone
        for name, grad in alone.items():
            torch.testing.assert_close(batched[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("rest_image", [True, False], ids=["image-in-a-rest", "text-rests"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_group_packed_into_one_row_gives_the_unpacked_gradient(
    process_group, tiny_path, media, family, rest_image, monkeypatch
):
    """Each group's four episodes run as one row, its prompt once: attention layers under the
    packed masks (Gemma 4's sliding window and bidirectional vision runs among them),
    linear-attention layers (Qwen3.5's, MiniCPM-V 4.6's) by segment from the prompt's end
    states. The gradient is the one-episode-per-pass gradient, with and without a KL term.
    A row whose rests hold no media takes its stack inputs from one forward over the row (its
    rests' positions moved back), one with an image in a rest from each episode's own."""
    from areno.train import packing

    whole_rows = []
    row_staged = packing._row_staged

    def counted(model, items, *args, **kwargs):
        whole_rows.append(bool(items[0].mm_spans))  # the packing check's rows are text
        return row_staged(model, items, *args, **kwargs)

    monkeypatch.setattr(packing, "_row_staged", counted)
    path = tiny_path(family)
    trajs = _group_trajectories(path, media, rest_image)
    for loss in ({"loss_agg": "token_mean"}, {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1}):
        rows: list = []
        alone, _ = _gradient(path, trajs, 0, loss)
        batched, passes = _gradient(path, trajs, 1 << 16, loss, rows)
        assert rows == [[[4, 4]]], rows  # one pass, a row per group
        assert alone.keys() == batched.keys() and alone
        for name, grad in alone.items():
            torch.testing.assert_close(batched[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(whole_rows) is not rest_image


def test_a_filler_pass_adds_no_gradient_and_no_metric(process_group, tiny_path, media):
    """A rank short of trajectories runs a filler so its reduction meets the others': it must
    leave the gradient and the step's sums as they were."""
    from areno.train.batching import MiniBatch
    from areno.train.learner import SUM_KEYS

    path = tiny_path("qwen3_5")
    trajs = _trajectories(path, media)
    learner = _learner(path, 0, 0, {"loss_agg": "token_mean"})
    try:
        learner.module.train()
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        filler = MiniBatch([[(trajs[0], 1.0)]], tokens=1, episodes=1, num_fillers=1)
        learner.accumulate(filler, sums)
        grads = [p.grad for p in learner.module.parameters() if p.requires_grad]
        assert all(g is None or not g.any() for g in grads)
        assert all(value == 0.0 for value in sums.values())
    finally:
        learner.deepspeed.destroy()


def test_mini_batches_and_epochs_take_that_many_optimizer_steps(process_group, tiny_path, media):
    """Two mini-batches over two epochs: four optimizer steps, each clipped against the
    rollout logprobs (the behaviour policy), so later passes see ratios away from 1."""
    path = tiny_path("qwen3_5")
    trajs = _trajectories(path, media)
    learner = _learner(path, 2, 1 << 16, {"loss_agg": "token_mean"}, mini_batches=2, epochs=2)
    try:
        pairs = list(zip(trajs, [1.0, -1.0] * 4, strict=True))
        (share,) = plan_step(pairs, 1, 2, 1 << 16)
        sums = learner.train_step(share)
        assert sums["steps"] == 4 and learner.deepspeed.global_steps == 4
        assert sums["rows"] == 2 * len(trajs)
        assert sums["ratio_max"] != pytest.approx(1.0)
    finally:
        learner.deepspeed.destroy()
