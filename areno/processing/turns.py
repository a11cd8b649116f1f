"""Multi-turn, token-in / token-out encoding for agent episodes.

An episode's prompt is encoded once. After each assistant turn (the generator's exact tokens,
ending with the family's end-of-turn token), only the NEW messages are encoded
(`encode_continuation`) and appended (`extend_prompt`): history is never re-templated, so the
trainer scores exactly the tokens the generator saw.

How the continuation is found: the chat template is rendered for a fixed dummy conversation
(a user turn + an assistant turn that called the tools being answered) with and without the new
messages. The longer render is cut right after the dummy assistant's end-of-turn token; what
follows is the text the template writes after a finished assistant turn, through the next
generation prompt. The dummy turns render identically in both, and nothing of them may reach the
cut-off text (both are checked). That text and the new media then take the one processor path
(`encode.run_processor`), exactly like a whole prompt; media in tool results that a template
cannot render moves into a user turn after them, on both paths (`encode.prepare_messages`).

`extend_prompt` joins the media tensors per family and key (`MERGE_RULES`) and continues the
per-prompt media numbers some families write (`MEDIA_ID_TAGS`, MiniCPM-V's `<image_id>k`), so the
result equals encoding the whole conversation at once.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areno.errors import ArenoError
from areno.media.types import DecodedMedia
from areno.models.registry import FamilyAdapter
from areno.processing.encode import prepare_messages, run_processor
from areno.processing.messages import to_template_messages, tools_as_dicts, validate_messages
from areno.processing.types import MediaSpan, PromptInputs

_DUMMY_USER = "AReno continuation probe (user)"
_DUMMY_ASSISTANT = "AReno continuation probe (assistant)"
_DUMMY_TOOL = "areno_continuation_probe_tool"
_CONTINUATION_ROLES = ("user", "tool", "system", "developer")


class ContinuationError(ArenoError):
    """The messages cannot be encoded as a continuation of a finished assistant turn."""

    code = "invalid_continuation"


class MediaMergeError(ArenoError):
    """A media tensor of a continuation cannot be merged onto the prompt before it."""

    code = "media_merge"


# ---------------------------------------------------------------------------------------------
# encode_continuation


def encode_continuation(
    hf_processor: Any,
    adapter: FamilyAdapter,
    messages: Sequence[Any],
    media: Sequence[DecodedMedia],
    *,
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
) -> PromptInputs:
    """The tokens the chat template writes right AFTER a finished assistant turn's end-of-turn
    token for `messages` (tool results, user or system messages), through the next assistant
    turn's generation prompt, plus the tensors of `media` (their decoded items, in order).

    Spans and media indices are relative to this delta; `extend_prompt` places it. Pass the same
    `tools` / `chat_template_kwargs` as for the episode's prompt.
    """
    checked = validate_messages(messages)
    if not checked:
        raise ContinuationError("a continuation needs at least one message (e.g. a tool result)")
    for i, message in enumerate(checked):
        if message.role not in _CONTINUATION_ROLES:
            raise ContinuationError(
                f"messages[{i}] has role {message.role!r}; a continuation holds only "
                f"{', '.join(_CONTINUATION_ROLES)} messages: an assistant turn's tokens come from "
                f"the generator (pass them to extend_prompt as generated_ids)",
                param=f"messages[{i}].role",
            )
    template_messages, items = prepare_messages(
        hf_processor, adapter, to_template_messages(checked), media, chat_template_kwargs
    )
    text = _continuation_text(
        hf_processor,
        adapter,
        template_messages,
        tools=tools_as_dicts(tools),
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs or {},
    )
    return run_processor(hf_processor, adapter, text, items)


def _dummy_turns(messages: list[dict]) -> list[dict]:
    """A user turn and an assistant turn that called every tool answered in `messages`."""
    calls = [
        {
            "id": m.get("tool_call_id"),
            "type": "function",
            "function": {"name": m.get("name") or _DUMMY_TOOL, "arguments": {}},
        }
        for m in messages
        if m["role"] == "tool"
    ]
    assistant: dict[str, Any] = {"role": "assistant", "content": _DUMMY_ASSISTANT}
    if calls:
        assistant["tool_calls"] = calls
    return [{"role": "user", "content": _DUMMY_USER}, assistant]


def _continuation_text(
    hf_processor: Any,
    adapter: FamilyAdapter,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict,
) -> str:
    dummy = _dummy_turns(messages)

    def render(conversation: list[dict], generation_prompt: bool) -> str:
        return hf_processor.apply_chat_template(
            conversation,
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **chat_template_kwargs,
        )

    head = render(dummy, False)
    full = render(dummy + messages, add_generation_prompt)
    end_of_turn = adapter.stop_tokens[0]
    cut = head.rfind(end_of_turn)
    if cut == -1 or cut < head.rfind(_DUMMY_ASSISTANT):
        raise ContinuationError(
            f"the {adapter.display_name} chat template does not close an assistant turn with "
            f"{end_of_turn!r} (the family's first stop token); cannot find where a generated turn "
            f"ends. Fix the checkpoint's chat template or the family's stop_tokens"
        )
    cut += len(end_of_turn)
    if full[:cut] != head[:cut]:
        raise ContinuationError(
            f"the {adapter.display_name} chat template is not prefix-stable: it renders a finished "
            f"assistant turn differently once more messages follow, so new messages cannot be "
            f"appended to the generated tokens. Rendered alone:\n{head[:cut]!r}\nfollowed by "
            f"the new messages:\n{full[:cut]!r}"
        )
    delta = full[cut:]
    for probe in (_DUMMY_USER, _DUMMY_ASSISTANT, _DUMMY_TOOL):
        if probe in delta:
            raise ContinuationError(
                f"the {adapter.display_name} chat template repeats part of the previous turns "
                f"({probe!r}) when it renders the new messages; give each tool message the "
                f"called function's `name`, or use a template that renders tool results alone"
            )
    return delta


# ---------------------------------------------------------------------------------------------
# extend_prompt


def reply_text(
    hf_processor: Any,
    adapter: FamilyAdapter,
    content: str,
    tool_calls: Sequence[tuple[str, dict]],
    *,
    tools: list[dict] | None,
    chat_template_kwargs: dict | None = None,
) -> str:
    """The text of an assistant reply (`content`, then calls of (name, arguments)) exactly as the
    chat template writes it after the generation prompt, without the end-of-turn token: what a
    model must generate to make those calls (a warm-start target)."""
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(tool_calls)
    ]
    user = [{"role": "user", "content": _DUMMY_USER}]
    assistant: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        assistant["tool_calls"] = calls
    kwargs = {"tools": tools, "tokenize": False, **(chat_template_kwargs or {})}
    prompt = hf_processor.apply_chat_template(user, add_generation_prompt=True, **kwargs)
    full = hf_processor.apply_chat_template([*user, assistant], **kwargs)
    shared = len(os.path.commonprefix([prompt, full]))
    if shared < len(prompt):  # the prompt opens something: back up to its line's start
        shared = prompt.rfind("\n", 0, shared) + 1
    opener = prompt[shared:]  # what the generation prompt adds beyond the assistant header
    end_of_turn = adapter.stop_tokens[0]
    end = full.find(end_of_turn, shared)
    body = full[shared:end]
    if end != -1 and body.startswith(opener):
        return body[len(opener) :]
    if end != -1 and opener.strip() == "<think>":
        # A generation prompt that opens reasoning (Qwen3.5): close it the way the template's
        # enable_thinking=false form does, then the reply.
        return "\n</think>\n\n" + body
    raise ContinuationError(
        f"the {adapter.display_name} chat template does not write an assistant turn as its "
        f"generation prompt followed by the reply and {end_of_turn!r}; cannot cut the reply"
    )


@dataclass(frozen=True)
class MergeRule:
    """How one `mm_inputs` key of a prompt and of its continuation join into one tensor.

    Tensors are concatenated along `dim`. With `pad` set, every other dim is first right-padded
    to the larger size with that value (what the processor does to a batch of items, e.g. audio
    features of different lengths). `per_token` keys run along the token sequence ([1, n]).
    """

    dim: int = 0
    pad: float | int | bool | None = None
    per_token: bool = False


_CAT = MergeRule()
_PER_TOKEN = MergeRule(dim=-1, per_token=True)
_QWEN_RULES = {
    "mm_token_type_ids": _PER_TOKEN,
    "pixel_values": _CAT,  # [num_patches, patch_dim]
    "image_grid_thw": _CAT,  # [num_images, 3]
    "pixel_values_videos": _CAT,
    "video_grid_thw": _CAT,
}
# NOTE: the one place that knows how each family's processor batches media; a key missing here
# is refused (MediaMergeError) rather than merged by guesswork.
MERGE_RULES: dict[str, dict[str, MergeRule]] = {
    "qwen3_5": _QWEN_RULES,
    "qwen3_vl": _QWEN_RULES,
    "gemma4": {
        "mm_token_type_ids": _PER_TOKEN,
        "pixel_values": MergeRule(pad=0.0),  # [num_images, max_patches, patch_dim]
        "image_position_ids": MergeRule(pad=-1),  # [num_images, max_patches, 2], -1 = padding
        "pixel_values_videos": MergeRule(pad=0.0),  # [num_frames, max_patches, patch_dim]
        "video_position_ids": MergeRule(pad=-1),
        "num_frames_per_video": _CAT,
        "input_features": MergeRule(pad=0.0),  # [num_audios, max_frames, num_mel]
        "input_features_mask": MergeRule(pad=False),  # [num_audios, max_frames]
    },
    "minicpmv4_6": {
        "pixel_values": MergeRule(dim=-1),  # [1, 3, patch, total_width]: patches packed in a row
        "target_sizes": _CAT,  # [num_slices, 2]
        "pixel_values_videos": MergeRule(dim=-1),
        "target_sizes_videos": _CAT,  # [num_frame_slices, 2]
    },
}
# Families whose processor numbers media per prompt (`<image_id>k</image_id>` before each image,
# counted per modality); a continuation's numbers restart at 0 and must continue the prompt's.
MEDIA_ID_TAGS: dict[str, tuple[str, str]] = {"minicpmv4_6": ("<image_id>", "</image_id>")}


def merge_rule(model_type: str, key: str) -> MergeRule:
    """The rule for `key` of `model_type`'s processor outputs, or a MediaMergeError naming it."""
    rule = MERGE_RULES.get(model_type, {}).get(key)
    if rule is None:
        raise MediaMergeError(
            f"no rule to merge the processor output {key!r} of a {model_type} prompt and its "
            f"continuation; add one to areno.processing.turns.MERGE_RULES[{model_type!r}]",
            param=key,
        )
    return rule


def _pad_to(value: torch.Tensor, target: list[int], dim: int, fill: Any) -> torch.Tensor:
    """`value` right-padded with `fill` to `target` in every dim but `dim`."""
    shape = tuple(value.shape[i] if i == dim else n for i, n in enumerate(target))
    if shape == tuple(value.shape):
        return value
    out = value.new_full(shape, fill)
    out[tuple(slice(0, n) for n in value.shape)] = value
    return out


def _merge_value(key: str, rule: MergeRule, head: Any, tail: Any) -> Any:
    if isinstance(head, list) and isinstance(tail, list) and rule.dim == 0:
        return head + tail
    if not (isinstance(head, torch.Tensor) and isinstance(tail, torch.Tensor)):
        raise MediaMergeError(f"cannot merge {key!r}: expected two tensors", param=key)
    if rule.pad is not None and head.ndim == tail.ndim:
        dim = rule.dim % head.ndim
        target = [max(a, b) for a, b in zip(head.shape, tail.shape, strict=True)]
        head = _pad_to(head, target, dim, rule.pad)
        tail = _pad_to(tail, target, dim, rule.pad)
    try:
        return torch.cat([head, tail], dim=rule.dim)
    except RuntimeError as e:
        raise MediaMergeError(
            f"cannot merge {key!r}: shapes {tuple(head.shape)} and {tuple(tail.shape)} do not "
            f"join along dim {rule.dim} ({e})",
            param=key,
        ) from None


def merge_mm_inputs(
    model_type: str,
    head: Mapping[str, Any],
    tail: Mapping[str, Any],
    num_head_tokens: int,
    num_tail_tokens: int,
) -> dict[str, Any]:
    """Media tensors of a prompt (`head`) followed by a continuation (`tail`), as the processor
    would have produced them for the whole token sequence at once."""
    merged: dict[str, Any] = {}
    for key in [*head, *(k for k in tail if k not in head)]:
        rule = merge_rule(model_type, key)
        a, b = head.get(key), tail.get(key)
        if rule.per_token:
            # A side without the key has no media tokens: all text (0).
            like = a if a is not None else b
            a = like.new_zeros(1, num_head_tokens) if a is None else a
            b = like.new_zeros(1, num_tail_tokens) if b is None else b
        merged[key] = a if b is None else b if a is None else _merge_value(key, rule, a, b)
    return merged


def extend_prompt(
    adapter: FamilyAdapter,
    prefix: PromptInputs,
    generated_ids: Sequence[int],
    delta: PromptInputs,
    tokenizer: Any = None,
) -> PromptInputs:
    """`prefix` + the generated tokens + a continuation from `encode_continuation`, as one prompt.

    Media tensors merge per key (`MERGE_RULES`); the delta's spans move by the tokens before it
    and its media indices continue the prefix's. Families that number media per prompt
    (`MEDIA_ID_TAGS`) get the delta's numbers continued, which needs the checkpoint's `tokenizer`
    (and can lengthen the delta by a token when a number gains a digit). With a tokenizer the
    generated tokens are decoded into `prompt_text`; without one that part is left out.
    """
    head = prefix.with_tokens([*prefix.input_ids, *generated_ids])
    offset = head.num_prompt_tokens
    mm_inputs = merge_mm_inputs(
        adapter.model_type, head.mm_inputs, delta.mm_inputs, offset, delta.num_prompt_tokens
    )
    num_prior = len(prefix.mm_spans)
    spans = [
        *prefix.mm_spans,
        *(
            dataclasses.replace(
                s, index=s.index + num_prior, start=s.start + offset, end=s.end + offset
            )
            for s in delta.mm_spans
        ),
    ]
    generated_text = tokenizer.decode(list(generated_ids)) if tokenizer is not None else ""
    merged = PromptInputs(
        input_ids=[*head.input_ids, *delta.input_ids],
        mm_inputs=mm_inputs,
        mm_spans=spans,
        prompt_text=prefix.prompt_text + generated_text + delta.prompt_text,
    )
    return _continue_media_ids(adapter, tokenizer, merged, num_prior)


def _continue_media_ids(
    adapter: FamilyAdapter, tokenizer: Any, inputs: PromptInputs, num_prior: int
) -> PromptInputs:
    """Renumber the media after the first `num_prior` spans so each modality's ids continue."""
    tags = MEDIA_ID_TAGS.get(adapter.model_type)
    counts = Counter(s.modality for s in inputs.mm_spans[:num_prior])
    new_spans = inputs.mm_spans[num_prior:]
    if tags is None or not any(counts[s.modality] for s in new_spans):
        return inputs
    if tokenizer is None:
        raise MediaMergeError(
            f"{adapter.display_name} numbers media per prompt, so extending a prompt that has "
            f"media needs the tokenizer: pass it (Processor.extend does)"
        )
    open_id, close_id = tokenizer.convert_tokens_to_ids(list(tags))
    ids = list(inputs.input_ids)
    spans: list[MediaSpan] = list(inputs.mm_spans[:num_prior])
    edits: list[tuple[int, int, int]] = []  # (position in the original ids, old length, new)
    shift = 0
    for span in new_spans:
        number = counts[span.modality]
        counts[span.modality] += 1
        start = span.start + shift
        if ids[start] != open_id:
            spans.append(dataclasses.replace(span, start=start, end=span.end + shift))
            continue
        close = ids.index(close_id, start)
        digits = tokenizer.encode(str(number), add_special_tokens=False)
        ids[start + 1 : close] = digits
        edits.append((span.start + 1, close - start - 1, len(digits)))
        diff = len(digits) - (close - start - 1)
        spans.append(dataclasses.replace(span, start=start, end=span.end + shift + diff))
        shift += diff
    mm_inputs = {
        key: _splice_text_tokens(value, edits)
        if merge_rule(adapter.model_type, key).per_token
        else value
        for key, value in inputs.mm_inputs.items()
    }
    return PromptInputs(ids, mm_inputs, spans, inputs.prompt_text)


def _splice_text_tokens(value: torch.Tensor, edits: list[tuple[int, int, int]]) -> torch.Tensor:
    """A per-token tensor after replacing text tokens (new ones are text: 0)."""
    pieces, pos = [], 0
    for at, old, new in edits:
        pieces += [value[:, pos:at], value.new_zeros(value.shape[0], new)]
        pos = at + old
    pieces.append(value[:, pos:])
    return torch.cat(pieces, dim=1)
