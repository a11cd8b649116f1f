"""The policy as the trainer holds it: the family's model with its media towers frozen, and the
log-probabilities it gives a trajectory's tokens (the same tokens and media the generator saw)."""

from __future__ import annotations

import copy
import logging
import os

import torch

from areno.models.registry import FamilyAdapter, adapter_for_checkpoint
from areno.processing.types import PromptInputs
from areno.train.batching import collate
from areno.train.grpo import token_logprobs
from areno.train.lora import PEFT_PREFIX, LoraConfig, apply_lora, base_model
from areno.train.packing import PackLayout, packed_logprobs

logger = logging.getLogger("areno.train")


def frozen_prefixes(adapter: FamilyAdapter, *, towers: bool, projectors: bool) -> tuple[str, ...]:
    """Module paths whose parameters do not train (the adapter's towers / projectors)."""
    return (adapter.media_towers if towers else ()) + (adapter.projectors if projectors else ())


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def load_policy(
    model_path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    freeze_towers: bool = True,
    freeze_projectors: bool = True,
    lora: LoraConfig | None = None,
) -> tuple[torch.nn.Module, FamilyAdapter, tuple[str, ...]]:
    """The model with frozen modules' `requires_grad` off; returns it, its adapter and the
    frozen module paths. With `lora` enabled, the model is a PEFT model whose adapters on the
    language model are all that trains (the towers stay frozen, whatever the flags say)."""
    adapter = adapter_for_checkpoint(model_path)
    model = adapter.load_model(model_path, dtype=dtype)
    prefixes = frozen_prefixes(adapter, towers=freeze_towers, projectors=freeze_projectors)
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora)
        prefixes = frozen_prefixes(adapter, towers=True, projectors=True)
        prefixes = tuple(PEFT_PREFIX + p for p in prefixes)
    for name, param in model.named_parameters():
        if _is_under(name, prefixes):
            param.requires_grad_(False)
    set_train_mode(model, prefixes)
    return model, adapter, prefixes


def set_train_mode(model: torch.nn.Module, frozen: tuple[str, ...]) -> None:
    """Train mode for the trained part; frozen towers stay in eval mode (no dropout, and
    norm statistics untouched)."""
    model.train()
    for name, module in model.named_modules():
        if _is_under(name, frozen):
            module.eval()


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (ZeRO-3 partitioned parameters counted whole)."""

    def numel(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)


def sequence_logprobs(
    model: torch.nn.Module,
    inputs: PromptInputs,
    device: str,
    start: int = 1,
    temperature: float = 1.0,
) -> torch.Tensor:
    """logprob of tokens start..N-1 under `model` ([N-start], float32), from one forward over
    the whole trajectory with its media; logits are kept only from position start-1 on.

    `temperature` divides the logits first: the rollout's sampling temperature, so that these
    logprobs and the generator's (`logprobs_mode="tempered"`) describe the same distribution.
    0 (greedy rollouts) and 1 leave them as they are."""
    batch = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.model_inputs().items()
    }
    ids = batch["input_ids"]
    keep = ids.shape[1] - start + 1
    logits = model(**batch, use_cache=False, logits_to_keep=keep).logits
    # NOTE: some families (MiniCPM-V 4.6) ignore logits_to_keep and return every position.
    logits = logits[:, -keep:]  # [1, keep, V]
    if temperature not in (0, 1):
        logits = logits / temperature
    return token_logprobs(logits[:, :-1], ids[:, start:])[0]


def batch_logprobs(
    model: torch.nn.Module,
    batch: list[PromptInputs],
    starts: list[int],
    device: str,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """`sequence_logprobs` of several trajectories from one forward over them as a right-padded
    batch (`areno.train.batching.collate`): row b's logprobs of its tokens starts[b]..N_b-1."""
    if len(batch) == 1:
        return [sequence_logprobs(model, batch[0], device, starts[0], temperature)]
    inputs = {k: v.to(device) for k, v in collate(batch).items()}
    ids = inputs["input_ids"]
    length = ids.shape[1]
    keep = length - min(starts) + 1
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits[:, -keep:]
    if temperature not in (0, 1):
        logits = logits / temperature
    offset = length - keep  # the position of logits[:, 0]
    rows = []
    for row, (item, start) in enumerate(zip(batch, starts, strict=True)):
        end = item.num_prompt_tokens
        picked = logits[row : row + 1, start - 1 - offset : end - 1 - offset]
        rows.append(token_logprobs(picked, ids[row : row + 1, start:end])[0])
    return rows


# How far a packed row's logprobs may be from the unpacked ones in the check: float32 on a probe
# of random weights (a packing bug moves them by far more; float32 rounding by ~1e-6).
PACK_TOLERANCE = 1e-4


def pack_layout(model: torch.nn.Module, device: str) -> PackLayout | None:
    """How the trainer packs a group's episodes into one row on `model` (`PackLayout.of`), once
    a packed row of two made-up text episodes has scored their tokens as their own forwards do,
    within PACK_TOLERANCE in float32, on a probe of `model`'s class and config
    (`_float32_probe`): the linear-attention layers run through transformers' own layer code,
    which another transformers version may write differently, and the check must see a small
    difference that bfloat16 rounding would hide. None (one trajectory a row) otherwise, with a
    warning that says why."""
    layout = PackLayout.of(model)
    if layout is None:
        return None
    try:
        worst = _packing_error(_float32_probe(model, device), device)
    except Exception as error:  # noqa: BLE001 (any failure means: do not pack)
        worst, why = float("inf"), f"{type(error).__name__}: {error}"
    else:
        why = f"its logprobs differ from the unpacked ones by {worst:.3g} in float32"
    if worst <= PACK_TOLERANCE:
        return layout
    logger.warning(
        "areno train: trains one trajectory a row, not a group's episodes packed: a packed "
        "row's check failed on this model (%s)",
        why,
    )
    return None


def _float32_probe(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A float32 model of `model`'s class and config with random weights, its text stack cut
    to the shortest prefix holding a layer of every kind it has and its media towers to one
    layer: the same layer code, at a fraction of the memory. Torch's random state is left as
    it was."""
    base = base_model(model)
    config = copy.deepcopy(base.config)
    text = config.get_text_config()
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"])
    num_layers = max(kinds.index(kind) for kind in set(kinds)) + 1
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = kinds[:num_layers]
    if getattr(text, "num_kv_shared_layers", 0):
        text.num_kv_shared_layers = 0
    for name in ("vision_config", "audio_config"):
        tower = getattr(config, name, None)
        for field in ("depth", "num_hidden_layers"):
            if tower is not None and isinstance(getattr(tower, field, None), int):
                setattr(tower, field, 1)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(0)
        return type(base)._from_config(config, dtype=torch.float32).eval()


def _packing_error(model: torch.nn.Module, device: str) -> float:
    """The largest difference between four made-up text episodes' logprobs scored alone and in
    two packed rows of `model`, a group each."""
    layout = PackLayout.of(model)
    if layout is None:
        raise ValueError("the probe has no packed layout")
    high = min(model.config.get_text_config().vocab_size, 1000)
    low = min(100, high // 2)  # past the special ids a vocabulary starts with, where it can
    ids = torch.randint(low, high, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # two groups whose prompts (12 and 10 shared tokens) one linear-attention forward runs
    # left-padded together (packing.shared_batches)
    rows = [
        [PromptInputs(ids[:17], {}), PromptInputs(ids[:12] + ids[17:], {})],
        [PromptInputs(ids[20:33], {}), PromptInputs(ids[20:30] + ids[33:37], {})],
    ]
    starts = [[10, 10], [9, 9]]
    with torch.no_grad():
        alone = [
            sequence_logprobs(model, item, device, start)
            for items, firsts in zip(rows, starts, strict=True)
            for item, start in zip(items, firsts, strict=True)
        ]
        packed = [lp for row in packed_logprobs(model, layout, rows, starts, device) for lp in row]
    return max(float((a - b).abs().max()) for a, b in zip(alone, packed, strict=True))
