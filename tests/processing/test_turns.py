"""Multi-turn token-in / token-out encoding: a prompt + generated tokens + an encoded continuation
must equal encoding the whole conversation at once (ids, media tensors, spans), per family."""

from __future__ import annotations

import json

import pytest
import torch

from areno.media.decoder import MediaDecoder
from areno.media.samples import write_audio, write_image, write_video
from areno.media.sources import MediaPolicy
from areno.models import get_adapter
from areno.processing import Processor, PromptInputs
from areno.processing.encode import placeholder_token_ids
from areno.processing.turns import (
    MEDIA_ID_TAGS,
    ContinuationError,
    MediaMergeError,
    extend_prompt,
    merge_mm_inputs,
)

FAMILIES = ["qwen3_5", "qwen3_vl", "gemma4", "minicpmv4_6"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "crop",
            "description": "Crop the image.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("turns-media")
    return {
        "image": write_image(d / "a.png", 64, 48),
        "big": write_image(d / "big.png", 320, 200, seed=2),  # MiniCPM-V slices it
        "audio": write_audio(d / "a.wav", seconds=1.0),
        "long_audio": write_audio(d / "b.wav", seconds=2.0, freq=330.0),  # pads the features
        "video": write_video(d / "a.mp4", seconds=2.0, fps=4.0),
    }


def worker(tiny_path, family):
    processor = Processor(tiny_path(family))
    return processor, MediaDecoder(MediaPolicy.for_training(), processor.decode_options())


def image(path):
    return {"type": "image_url", "image_url": {"url": str(path)}}


def audio(path):
    return {"type": "audio_url", "audio_url": {"url": str(path)}}


def video(path):
    return {"type": "video_url", "video_url": {"url": str(path)}}


def text(value):
    return {"type": "text", "text": value}


def episode(family, media):
    """user(text + image) -> assistant (a tool call) -> tool result with media."""
    user = [image(media["image"]), text("zoom in")]
    result = [text("cropped:"), image(media["big"])]
    if family == "gemma4":
        user.append(audio(media["audio"]))
        result.append(audio(media["long_audio"]))
    if family == "qwen3_vl":
        result.append(video(media["video"]))
    assistant = {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "crop", "arguments": "{}"}}
        ],
    }
    if family == "qwen3_5":
        # Its generation prompt opens <think>; a past turn renders that only with reasoning.
        assistant["reasoning_content"] = "I should crop."
    tool = {"role": "tool", "tool_call_id": "call_1", "content": result}
    return [{"role": "user", "content": user}], assistant, [tool]


def generated_turn(processor, prefix, whole, delta):
    """The assistant turn as a generator produces it: the template's text for that turn,
    tokenized on its own, ending with the end-of-turn token."""
    assert whole.prompt_text.startswith(prefix.prompt_text)
    assert whole.prompt_text.endswith(delta.prompt_text)
    turn = whole.prompt_text[
        len(prefix.prompt_text) : len(whole.prompt_text) - len(delta.prompt_text)
    ]
    ids = processor.tokenizer(turn, add_special_tokens=False)["input_ids"]
    eot = processor.tokenizer.convert_tokens_to_ids(processor.adapter.stop_tokens[0])
    assert ids[-1] == eot
    return ids


def run_episode(processor, decoder, prompt, assistant, results):
    """Encode the prompt, the continuation and the whole conversation; return all four."""
    decode = lambda messages: decoder.decode_many(processor.media_refs(messages))  # noqa: E731
    prefix = processor.encode(prompt, decode(prompt), tools=TOOLS)
    whole_messages = [*prompt, assistant, *results]
    whole = processor.encode(whole_messages, decode(whole_messages), tools=TOOLS)
    delta = processor.encode_continuation(results, decode(results), tools=TOOLS)
    generated = generated_turn(processor, prefix, whole, delta)
    return prefix, generated, delta, whole


def assert_same_prompt(processor, merged: PromptInputs, whole: PromptInputs):
    assert merged.input_ids == whole.input_ids
    assert merged.mm_inputs.keys() == whole.mm_inputs.keys()
    for key, value in whole.mm_inputs.items():
        assert torch.equal(merged.mm_inputs[key], value), key
    assert merged.mm_spans == whole.mm_spans
    placeholder = placeholder_token_ids(processor.hf_processor)
    for span in merged.mm_spans:
        count = merged.input_ids[span.start : span.end].count(placeholder[span.modality])
        assert count == span.num_placeholder_tokens > 0
    assert merged.prompt_text == whole.prompt_text


@pytest.mark.parametrize("family", FAMILIES)
def test_continuation_extends_to_the_whole_conversation(tiny_path, media, family):
    processor, decoder = worker(tiny_path, family)
    prompt, assistant, results = episode(family, media)
    prefix, generated, delta, whole = run_episode(processor, decoder, prompt, assistant, results)

    # The delta holds only the new turn: nothing of the dummy turns, nor of the prompt's media.
    assert "probe" not in delta.prompt_text and "zoom in" not in delta.prompt_text
    assert [s.index for s in delta.mm_spans] == list(range(len(delta.mm_spans)))
    if family not in MEDIA_ID_TAGS:  # MiniCPM-V numbers media per prompt: extend renumbers
        assert prefix.input_ids + generated + delta.input_ids == whole.input_ids

    merged = processor.extend(prefix, generated, delta)
    assert_same_prompt(processor, merged, whole)
    expected = {
        "qwen3_5": ["image", "image"],
        "qwen3_vl": ["image", "image", "video"],
        "gemma4": ["image", "audio", "image", "audio"],
        "minicpmv4_6": ["image", "image"],
    }[family]
    assert [s.modality for s in merged.mm_spans] == expected
    assert [s.index for s in merged.mm_spans] == list(range(len(expected)))

    model = processor.adapter.load_model(tiny_path(family)).eval()
    with torch.no_grad():
        logits = model(**merged.model_inputs()).logits
    assert logits.shape[1] == merged.num_prompt_tokens


def test_several_tool_results_and_a_user_message(tiny_path, media):
    """Consecutive tool results share one templated turn; a user message may follow them."""
    processor, decoder = worker(tiny_path, "qwen3_vl")
    prompt, assistant, _ = episode("qwen3_vl", media)
    assistant["tool_calls"].append(
        {"id": "call_2", "type": "function", "function": {"name": "crop", "arguments": "{}"}}
    )
    results = [
        {"role": "tool", "tool_call_id": "call_1", "content": [image(media["big"])]},
        {"role": "tool", "tool_call_id": "call_2", "content": "no crop needed"},
        {"role": "user", "content": [text("and this one?"), image(media["image"])]},
    ]
    prefix, generated, delta, whole = run_episode(processor, decoder, prompt, assistant, results)
    assert delta.prompt_text.count("<|im_start|>user") == 2
    assert_same_prompt(processor, processor.extend(prefix, generated, delta), whole)


def test_media_numbers_continue_past_nine(tiny_path, media):
    """MiniCPM-V writes <image_id>k</image_id> per prompt; the continuation's count continues,
    even where the number gains a digit (a token)."""
    processor, decoder = worker(tiny_path, "minicpmv4_6")
    prompt = [{"role": "user", "content": [image(media["image"])] * 10}]
    _, assistant, results = episode("minicpmv4_6", media)
    prefix, generated, delta, whole = run_episode(processor, decoder, prompt, assistant, results)
    merged = processor.extend(prefix, generated, delta)
    assert (
        merged.num_prompt_tokens
        == prefix.num_prompt_tokens + len(generated) + len(delta.input_ids) + 1
    )
    assert_same_prompt(processor, merged, whole)
    assert "<image_id>10</image_id>" in processor.tokenizer.decode(merged.input_ids)


def _swap_template(processor, old: str, new: str) -> None:
    template = processor.hf_processor.chat_template
    assert old in template
    processor.hf_processor.chat_template = template.replace(old, new)


def test_media_a_template_drops_from_tool_results_moves_to_a_user_turn(tiny_path, media):
    processor, decoder = worker(tiny_path, "qwen3_vl")
    _swap_template(  # a template that renders only the text of tool results
        processor,
        "<tool_response>\n{{ render_content(message.content) }}",
        "<tool_response>\n{{ message.content if message.content is string else "
        "message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join }}",
    )
    prompt, assistant, results = episode("qwen3_vl", media)
    prefix, generated, delta, whole = run_episode(processor, decoder, prompt, assistant, results)
    assert delta.prompt_text.startswith(
        "\n<|im_start|>user\n<tool_response>\ncropped:\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|video_pad|><|im_end|>"
    )
    assert [s.modality for s in delta.mm_spans] == ["image", "video"]
    assert_same_prompt(processor, processor.extend(prefix, generated, delta), whole)


def test_template_that_rewrites_past_turns_is_refused(tiny_path, media):
    processor, decoder = worker(tiny_path, "qwen3_vl")
    _swap_template(  # like templates that drop past turns' reasoning
        processor,
        "<|im_start|>assistant\n{{ render_content(message.content) }}",
        "<|im_start|>assistant\n{{ render_content(message.content) if loop.last else '' }}",
    )
    _, _, results = episode("qwen3_vl", media)
    results[0]["content"] = "done"
    with pytest.raises(ContinuationError, match="not prefix-stable"):
        processor.encode_continuation(results, [])


def test_assistant_messages_are_refused(tiny_path):
    processor, _ = worker(tiny_path, "qwen3_5")
    with pytest.raises(ContinuationError, match=r"messages\[0\] has role 'assistant'"):
        processor.encode_continuation([{"role": "assistant", "content": "hi"}], [])


def test_unknown_media_key_is_refused_by_name():
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(MediaMergeError, match=r"'mystery_features'.*MERGE_RULES\['gemma4'\]"):
        merge_mm_inputs("gemma4", {"mystery_features": ids}, {}, 2, 0)
    prefix = PromptInputs([1, 2], {"pixel_values": torch.zeros(4, 8)})
    delta = PromptInputs([3], {"pixel_values": torch.zeros(4, 8), "pixel_extras": ids})
    with pytest.raises(MediaMergeError, match="'pixel_extras'"):
        extend_prompt(get_adapter("qwen3_5"), prefix, [5], delta)


def test_padded_features_merge_to_a_common_length():
    head = {"input_features": torch.ones(1, 3, 2), "input_features_mask": torch.ones(1, 3).bool()}
    tail = {"input_features": torch.ones(1, 5, 2), "input_features_mask": torch.ones(1, 5).bool()}
    merged = merge_mm_inputs("gemma4", head, tail, 4, 6)
    assert merged["input_features"].shape == (2, 5, 2)
    assert merged["input_features"][0, 3:].eq(0).all()
    assert merged["input_features_mask"].sum(dim=1).tolist() == [3, 5]
    with pytest.raises(MediaMergeError, match="'pixel_values'.*do not join"):
        merge_mm_inputs(
            "qwen3_5", {"pixel_values": torch.ones(2, 3)}, {"pixel_values": torch.ones(2, 4)}, 1, 1
        )


SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit_answer",
        "description": "Submit the answer.",
        "parameters": {
            "type": "object",
            "properties": {"label": {"type": "string"}, "start_s": {"type": "number"}},
            "required": ["label"],
        },
    },
}


@pytest.mark.parametrize("family", FAMILIES)
def test_reply_text_is_what_the_family_parser_reads_as_the_call(tiny_path, family):
    """A warm-start target: the template's own text for a call, which the generation prompt
    continues into and the family's parser turns back into the same call."""
    from areno.tools import get_tool_parser

    processor = Processor(tiny_path(family))
    arguments = {"label": "dog barking", "start_s": 1}
    text = processor.reply_text("", [("submit_answer", arguments)], tools=[SUBMIT])
    parser = get_tool_parser(processor.adapter.tool_format)

    [call] = parser.parse(text, [SUBMIT]).tool_calls
    assert call.function.name == "submit_answer"
    assert json.loads(call.function.arguments) == arguments
    assert processor.adapter.stop_tokens[0] not in text
