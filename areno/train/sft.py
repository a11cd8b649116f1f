"""`areno sft`: a short supervised warm-start on the same data path as GRPO.

Each sample's prompt goes through the one processor path (MediaDecoder + Processor); the target
is a string from its private metadata (`target_key`), followed by the end-of-turn token. Only
the target tokens are trained on, with the media towers frozen as in GRPO. Single process: a
warm-start is minutes on small models; the output is a checkpoint directory GRPO starts from.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from areno.data import load_samples
from areno.errors import ConfigError
from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.processor import Processor
from areno.processing.types import PromptInputs
from areno.train.checkpoint import export_hf
from areno.train.policy import load_policy, sequence_logprobs, set_train_mode


@dataclass
class SFTConfig:
    model_path: str
    out_dir: str
    loader: str
    loader_kwargs: dict
    target_key: str = "answer"
    steps: int = 50
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0


def _encode(processor: Processor, decoder: MediaDecoder, sample, target: str) -> PromptInputs:
    media = decoder.decode_many(processor.media_refs(sample.messages))
    prompt = processor.encode(sample.messages, media, tools=sample.tools)
    tokenizer = processor.tokenizer
    eot = tokenizer.convert_tokens_to_ids(processor.adapter.stop_tokens[0])
    target_ids = tokenizer.encode(target, add_special_tokens=False) + [eot]
    return prompt.with_tokens(prompt.input_ids + target_ids), prompt.num_prompt_tokens


def sft(config: SFTConfig, log=print) -> Path:
    """Train and write the checkpoint; returns its directory."""
    torch.manual_seed(config.seed)
    samples = list(load_samples(config.loader, **config.loader_kwargs))
    if not samples:
        raise ConfigError(f"loader {config.loader} yielded no samples")
    processor = Processor(config.model_path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    examples = []
    for sample in samples:
        if config.target_key not in sample.private:
            raise ConfigError(
                f"sample {sample.id!r} has no private[{config.target_key!r}] to train on"
            )
        examples.append(_encode(processor, decoder, sample, str(sample.private[config.target_key])))
    model, _, frozen = load_policy(config.model_path, dtype=torch.float32)
    set_train_mode(model, frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    rng = random.Random(config.seed)
    start = time.perf_counter()
    for step in range(config.steps):
        batch = rng.sample(examples, min(config.batch_size, len(examples)))
        optimizer.zero_grad()
        total = 0.0
        for inputs, prompt_len in batch:
            loss = -sequence_logprobs(model, inputs, "cpu", prompt_len).mean() / len(batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 10 == 0 or step == config.steps - 1:
            log(f"sft step {step + 1}/{config.steps} loss {total:.4f}")
    log(f"sft: {config.steps} steps in {time.perf_counter() - start:.1f} s")
    out = export_hf(model, config.model_path, config.out_dir, zero_stage=0, rank=0)
    return Path(os.fspath(out))
