"""The baseline of `engine_throughput.py`: Hugging Face `generate` over the same requests as the
engine, greedy, with a static cache (for which `generate` compiles the decode step on CUDA) or
the dynamic one; prompts left-padded into batches of the run's concurrency, output tokens
counted up to each request's max_tokens or first EOS."""

from __future__ import annotations

import time

import torch
from engine_workloads import GcPauses, synchronize

from areno.processing import PromptInputs


def pad_batch(requests: list[dict], pad_token_id: int, device: torch.device) -> dict:
    """Left-padded ids and mask, plus the batch's media tensors, for one `generate` call."""
    prompts = [r["prompt_inputs"] for r in requests]
    length = max(p.num_prompt_tokens for p in prompts)
    ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, length - p.num_prompt_tokens :] = torch.tensor(p.input_ids)
        mask[row, length - p.num_prompt_tokens :] = 1
    batch = {"input_ids": ids, "attention_mask": mask, **_batch_media(prompts, length)}
    return {k: v.to(device) for k, v in batch.items()}


def _batch_media(prompts: list[PromptInputs], length: int) -> dict[str, torch.Tensor]:
    """Per-token tensors (mm_token_type_ids) left-padded like the ids; per-item tensors
    (pixel_values, image_grid_thw, ...) concatenated along the item axis in request order."""
    media = {}
    for key in sorted({k for p in prompts for k in p.mm_inputs}):
        having = [p for p in prompts if key in p.mm_inputs]
        if not all(_is_per_token(p.mm_inputs[key], p) for p in having):
            media[key] = torch.cat([p.mm_inputs[key] for p in having])
            continue
        first = having[0].mm_inputs[key]
        padded = torch.zeros((len(prompts), length, *first.shape[2:]), dtype=first.dtype)
        for row, p in enumerate(prompts):
            if key in p.mm_inputs:
                padded[row, length - p.num_prompt_tokens :] = p.mm_inputs[key][0]
        media[key] = padded
    return media


def _is_per_token(value: torch.Tensor, prompt: PromptInputs) -> bool:
    return value.dim() >= 2 and tuple(value.shape[:2]) == (1, prompt.num_prompt_tokens)


def useful_tokens(generated: list[int], max_tokens: int, eos_ids: set[int]) -> int:
    """Tokens a request asked for: up to and including its first EOS, at most max_tokens."""
    for i, token in enumerate(generated[:max_tokens]):
        if token in eos_ids:
            return i + 1
    return min(max_tokens, len(generated))


def _generate(model, batch: dict, max_new_tokens: int, ignore_eos: bool, cache: str, pad: int):
    return model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if ignore_eos else None,
        do_sample=False,
        cache_implementation=cache,
        pad_token_id=pad,
    )


@torch.inference_mode()
def run_hf_generate(
    model: torch.nn.Module, requests: list[dict], batch_size: int, cache_implementation: str
) -> dict:
    """`generate` over padded batches of `batch_size` requests; useful output tokens per second."""
    device = model.device
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = model.generation_config.pad_token_id or 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    # Warm-up off the clock. On CUDA a static cache makes generate compile the forward, so the
    # warm-up runs the full first batch (the gpu workload's batches all share its shapes).
    first = batches[0]
    warm_tokens = max(r["max_tokens"] for r in first) if device.type == "cuda" else 2
    _generate(model, pad_batch(first, pad, device), warm_tokens, True, cache_implementation, pad)
    synchronize(device)
    num_tokens = 0
    with GcPauses() as pauses:
        start = time.perf_counter()
        for batch in batches:
            inputs = pad_batch(batch, pad, device)
            max_new = max(r["max_tokens"] for r in batch)
            ignore_eos = all(r["ignore_eos"] for r in batch)
            out = _generate(model, inputs, max_new, ignore_eos, cache_implementation, pad)
            generated = out[:, inputs["input_ids"].shape[1] :].tolist()
            for r, row in zip(batch, generated, strict=True):
                limit_eos = set() if r["ignore_eos"] else eos_ids
                num_tokens += useful_tokens(row, r["max_tokens"], limit_eos)
        synchronize(device)
        wall_s = time.perf_counter() - start
    return {
        "output_tokens": num_tokens,
        "wall_s": wall_s,
        "tok_s": num_tokens / wall_s,
        **pauses.report(),
    }
