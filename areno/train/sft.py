"""`areno sft`: a short supervised warm-start on the same data path as GRPO.

Each sample's prompt goes through the one processor path (MediaDecoder + Processor); the target
is its private metadata's `target_key`: a string, or a reply `{"content": ..., "tool_calls":
[{"name": ..., "arguments": {...}}]}` written out by the checkpoint's own chat template (so a
tool-calling warm-start learns the family's call format), followed by the end-of-turn token. Only
the target tokens are trained on, with the media towers frozen as in GRPO. Single process: a
warm-start is minutes on small models; the output is a checkpoint directory GRPO starts from,
or with `lora.rank` > 0 a PEFT adapter directory (only the adapters train; areno/train/lora.py).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areno.data import load_samples
from areno.errors import ConfigError
from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.encode import SAMPLE_ERRORS, sample_error_text
from areno.processing.processor import Processor
from areno.processing.types import PromptInputs
from areno.rollout.agent import Agent, load_agent
from areno.train.checkpoint import export_hf
from areno.train.lora import LoraConfig, export_adapter
from areno.train.policy import load_policy, sequence_logprobs, set_train_mode


@dataclass
class SFTConfig:
    model_path: str
    out_dir: str
    loader: str
    loader_kwargs: dict
    target_key: str = "answer"
    agent: str | None = None  # module:callable; its system prompt and tools shape the prompt
    agent_kwargs: dict = field(default_factory=dict)
    steps: int = 50
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    # rank > 0: train LoRA adapters and write a PEFT adapter directory (areno/train/lora.py)
    lora: LoraConfig = field(default_factory=LoraConfig)


def target_text(processor: Processor, sample, target, tools=None) -> str:
    """The text to learn: a string as is, a reply with tool calls as the template writes it."""
    if isinstance(target, str):
        return target
    if isinstance(target, dict) and set(target) <= {"content", "tool_calls"}:
        calls = [(call["name"], call.get("arguments", {})) for call in target.get("tool_calls", [])]
        return processor.reply_text(target.get("content", ""), calls, tools=tools)
    raise ConfigError(
        f"sample {sample.id!r}: a warm-start target is a string or a reply "
        f'{{"content": ..., "tool_calls": [{{"name": ..., "arguments": {{...}}}}]}}; got {target!r}'
    )


def _encode(
    processor: Processor, decoder: MediaDecoder, sample, target, agent: Agent
) -> tuple[PromptInputs, int]:
    """The sample's prompt exactly as a rollout encodes it (`encode_prompt_for`: the agent's
    system prompt, its tools and the sample's) followed by the target's tokens and the
    end-of-turn token."""
    messages = agent.prompt_messages(sample.messages)
    tools = agent.prompt_tools(sample.tools, sample.id)
    media = decoder.decode_many(processor.media_refs(messages))
    prompt = processor.encode(messages, media, tools=tools)
    tokenizer = processor.tokenizer
    eot = tokenizer.convert_tokens_to_ids(processor.adapter.stop_tokens[0])
    text = target_text(processor, sample, target, tools)
    target_ids = tokenizer.encode(text, add_special_tokens=False) + [eot]
    return prompt.with_tokens(prompt.input_ids + target_ids), prompt.num_prompt_tokens


def sft(config: SFTConfig, log=print) -> Path:
    """Train and write the checkpoint; returns its directory."""
    torch.manual_seed(config.seed)
    samples = list(load_samples(config.loader, **config.loader_kwargs))
    if not samples:
        raise ConfigError(f"loader {config.loader} yielded no samples")
    processor = Processor(config.model_path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    agent = load_agent(config.agent, **config.agent_kwargs)  # None: the plain answerer
    examples, skipped = [], []
    for sample in samples:
        if config.target_key not in sample.private:
            raise ConfigError(
                f"sample {sample.id!r} has no private[{config.target_key!r}] to train on"
            )
        target = sample.private[config.target_key]
        try:
            examples.append(_encode(processor, decoder, sample, target, agent))
        except SAMPLE_ERRORS as error:  # its own media or length, as GRPO skips it
            skipped.append(f"sample {sample.id!r} skipped: {sample_error_text(error)}")
            log(f"sft: {skipped[-1]}")
    if not examples:
        raise ConfigError(
            f"every sample of {config.loader} was skipped ({len(samples)}); the first: {skipped[0]}"
        )
    model, _, frozen = load_policy(config.model_path, dtype=torch.float32, lora=config.lora)
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
    if config.lora.enabled:
        return export_adapter(model, config.model_path, config.out_dir)
    out = export_hf(model, config.model_path, config.out_dir, zero_stage=0, rank=0)
    return Path(os.fspath(out))
