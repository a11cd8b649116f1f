"""A trainer pass over GRPO groups whose episodes share a long multimodal prompt: one episode per
pass, a group's episodes as padded rows of one pass, a group packed into one row, its prompt
once (`areno.train.packing`), a pass a group, and every group a packed row of one pass (as the
trainer runs a step's groups), side by side in one run on the same episodes.

Each of `--groups` groups starts from one encoded prompt (a clip's frames, with its audio track
where the family takes audio, and a question); its `--group-size` episodes continue it with
`--rest-tokens` random ids each (their replies and tool results, lengths 0.5-1.5x). Per mode:
the median seconds of forward + backward over every episode (the loss is the sum of the
response tokens' logprobs), the tokens the passes ran, and the largest difference of any
episode's logprobs from the one-per-pass ones. Frozen towers answer from an encoder cache, as
the trainer's do.

    python benchmarks/trainer_packing.py --size small                     # Gemma 4, CPU
    python benchmarks/trainer_packing.py --family qwen3_5 --size 2b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import synchronize, write_results  # noqa: E402

from areno.engine.runner.encoder_cache import EncoderCache  # noqa: E402
from areno.media.decoder import MediaDecoder  # noqa: E402
from areno.media.samples import write_video  # noqa: E402
from areno.media.sources import MediaPolicy  # noqa: E402
from areno.models.tiny import TINY_SIZES, tiny_checkpoint  # noqa: E402
from areno.processing import Processor, process_messages  # noqa: E402
from areno.train.lora import base_model  # noqa: E402
from areno.train.packing import packed_logprobs, row_length  # noqa: E402
from areno.train.policy import batch_logprobs, load_policy, pack_layout  # noqa: E402

MODES = ("one per pass", "padded rows", "packed rows", "packed pass")


def groups(path: str, args, workdir: Path) -> list[list]:
    """`args.groups` groups of `args.group_size` (inputs, start) episodes."""
    processor = Processor(path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    rng = torch.Generator().manual_seed(args.seed)
    vocab = min(processor.tokenizer.vocab_size, 4000)
    out = []
    for g in range(args.groups):
        with_audio = "audio" in processor.adapter.modalities
        clip = write_video(workdir / f"clip{g}.mp4", seconds=4.0, fps=4.0, with_audio=with_audio)
        part = {"type": "video_url", "video_url": {"url": str(clip)}}
        question = {"type": "text", "text": f"Clip {g}: which event is this, and when?"}
        prompt = process_messages(
            processor, decoder, [{"role": "user", "content": [part, question]}]
        )
        episodes = []
        for _ in range(args.group_size):
            n = int(args.rest_tokens * (0.5 + torch.rand(1, generator=rng).item()))
            rest = torch.randint(100, vocab, (n,), generator=rng).tolist()
            episodes.append((prompt.with_tokens(prompt.input_ids + rest), prompt.num_prompt_tokens))
        out.append(episodes)
    return out


def run_mode(model, layout, mode: str, episodes: list[list], device: str, features) -> list:
    """Forward + backward of every episode in `mode`; each episode's logprobs (detached)."""
    model.zero_grad(set_to_none=True)
    rows = []
    if mode == "packed pass":  # every group a packed row of one pass, as the trainer runs a step
        out = packed_logprobs(
            model,
            layout,
            [[x for x, _ in group] for group in episodes],
            [[s for _, s in group] for group in episodes],
            device,
            around=lambda item: features.around(item.mm_spans),
        )
        out = [lp for row in out for lp in row]
        torch.stack([lp.float().sum() for lp in out]).sum().backward()
        return [lp.detach().float().cpu() for lp in out]
    for group in episodes:
        items = [x for x, _ in group]
        starts = [s for _, s in group]

        def around(item):
            return features.around(item.mm_spans)

        if mode == "packed rows":
            (out,) = packed_logprobs(model, layout, [items], [starts], device, around=around)
        elif mode == "padded rows":
            spans = [span for item in items for span in item.mm_spans]
            with features.around(spans):
                out = batch_logprobs(model, items, starts, device)
        else:
            out = []
            for item, start in zip(items, starts, strict=True):
                with around(item):
                    out += batch_logprobs(model, [item], [start], device)
        torch.stack([lp.float().sum() for lp in out]).sum().backward()
        rows += [lp.detach().float().cpu() for lp in out]
    return rows


def tokens_run(mode: str, episodes: list[list]) -> int:
    if mode in ("packed rows", "packed pass"):
        return sum(row_length([x for x, _ in group]) for group in episodes)
    if mode == "padded rows":
        return sum(len(group) * max(x.num_prompt_tokens for x, _ in group) for group in episodes)
    return sum(x.num_prompt_tokens for group in episodes for x, _ in group)


def profile_pass(model, layout, episodes, device: str, features) -> dict:
    """One pass of every group's packed row under torch.profiler: the top operators by host and by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    synchronize(torch.device(device))
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run_mode(model, layout, "packed pass", episodes, device, features)
        synchronize(torch.device(device))
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunch")))
    for key in ["self_cpu_time_total"] + (["self_device_time_total"] if busy else []):
        print(f"\npacked pass, top operators by {key} (wall {wall:.3f} s under the profiler)")
        print(events.table(sort_by=key, row_limit=15, max_name_column_width=60))
    print(f"device busy {busy:.3f} s of {wall:.3f} s; {launches} kernel launches")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_s": wall,
        "device_busy_s": busy,
        "kernel_launches": launches,
        "top_host_ops": {
            e.key: {"self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma4")
    parser.add_argument("--size", choices=TINY_SIZES, default="tiny")
    parser.add_argument("--model-path", help="a checkpoint instead of the embedded tiny one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--rest-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timing, one packed pass under torch.profiler: its top operators by "
        "host and by device time, and how much of the pass the device was busy",
    )
    parser.add_argument("--out", help="default benchmarks/results/trainer_packing_FAMILY_SIZE.json")
    args = parser.parse_args()
    path = args.model_path or str(tiny_checkpoint(args.family, args.size))
    dtype = getattr(torch, args.dtype)
    model, adapter, frozen = load_policy(path, dtype=dtype)
    model.to(args.device).train()
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in frozen):
            module.eval()
    layout = pack_layout(model, args.device)
    if layout is None:
        raise SystemExit("this model does not pack (see the warning above)")
    features = EncoderCache(base_model(model), 1 << 30)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        episodes = groups(path, args, Path(tmp))
    results, reference = {}, None
    # a family whose forward cannot take two prompts' media has no padded rows of them
    modes = [m for m in args.modes.split(",") if adapter.batched_media or m != "padded rows"]
    for mode in modes:
        times = []
        for _ in range(args.repeats + 1):  # the first warms up (and fills the encoder cache)
            synchronize(device)
            start = time.perf_counter()
            rows = run_mode(model, layout, mode, episodes, args.device, features)
            synchronize(device)
            times.append(time.perf_counter() - start)
        times = sorted(times[1:])
        reference = reference or rows
        diff = max(float((a - b).abs().max()) for a, b in zip(reference, rows, strict=True))
        results[mode] = {
            "seconds": times[len(times) // 2],
            "tokens_run": tokens_run(mode, episodes),
            "max_logprob_diff": diff,
        }
    base = results[modes[0]]["seconds"]
    trajectory_tokens = tokens_run("one per pass", episodes)
    print(f"{args.family} {args.size}, {args.device} {args.dtype}: {args.groups} groups x")
    print(f"{args.group_size} episodes, {trajectory_tokens} trajectory tokens")
    print(f"{'mode':16}{'seconds':>10}{'tokens run':>12}{'speed-up':>10}{'max |dlogp|':>13}")
    for mode, row in results.items():
        speed = base / row["seconds"]
        print(
            f"{mode:16}{row['seconds']:>10.3f}{row['tokens_run']:>12}{speed:>9.2f}x"
            f"{row['max_logprob_diff']:>13.2e}"
        )
    if args.profile:
        results["profile"] = profile_pass(model, layout, episodes, args.device, features)
    meta = {k: v for k, v in vars(args).items() if k != "out"} | {"model_path": path}
    out = args.out or f"benchmarks/results/trainer_packing_{args.family}_{args.size}.json"
    write_results(out, meta, {"results": results})


if __name__ == "__main__":
    main()
