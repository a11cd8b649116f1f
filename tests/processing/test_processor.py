"""The shared processor path: spans, limits, parity between entry points, errors."""

from __future__ import annotations

import base64

import pytest
import torch

from areno.errors import PromptTooLongError, UnsupportedModalityError
from areno.media.decoder import MediaDecoder
from areno.media.samples import write_audio, write_image, write_video
from areno.media.sources import MediaPolicy
from areno.processing import Processor, PromptLimits, process_messages
from areno.processing.encode import UnprocessableMediaError
from areno.protocol import RequestValidationError


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    return {
        "image": write_image(d / "a.png", 64, 48),
        "image2": write_image(d / "b.jpg", 96, 64, seed=1),
        "audio": write_audio(d / "a.wav", seconds=1.0),
        "video": write_video(d / "a.mp4", seconds=2.0, fps=4.0),
        "video_av": write_video(d / "av.mp4", seconds=2.0, fps=4.0, with_audio=True),
    }


def worker(tiny_path, family, limits=None):
    processor = Processor(tiny_path(family), limits=limits or PromptLimits())
    return processor, MediaDecoder(MediaPolicy.for_training(), processor.decode_options())


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image(path):
    return {"type": "image_url", "image_url": {"url": str(path)}}


def video(path):
    return {"type": "video_url", "video_url": {"url": str(path)}}


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "minicpmv4_6"])
def test_several_items_get_ordered_disjoint_spans(tiny_path, media, family):
    processor, decoder = worker(tiny_path, family)
    messages = user(
        image(media["image"]),
        {"type": "text", "text": "and"},
        video(media["video"]),
        image(media["image2"]),
        {"type": "text", "text": "compare them"},
    )
    inputs = process_messages(processor, decoder, messages)
    assert [s.modality for s in inputs.mm_spans] == ["image", "video", "image"]
    assert [s.index for s in inputs.mm_spans] == [0, 1, 2]
    for before, after in zip(inputs.mm_spans, inputs.mm_spans[1:], strict=False):
        assert before.end <= after.start
    assert inputs.mm_spans[0].content_hash != inputs.mm_spans[2].content_hash
    for modality in ("image", "video"):
        token_id = getattr(processor.hf_processor, f"{modality}_token_id")
        assert inputs.input_ids.count(token_id) == inputs.num_tokens(modality)


def test_qwen_counts_follow_the_grid(tiny_path, media):
    processor, decoder = worker(tiny_path, "qwen3_5")
    inputs = process_messages(
        processor, decoder, user(image(media["image"]), video(media["video"]))
    )
    merge = processor.hf_processor.image_processor.merge_size**2
    image_grid = inputs.mm_inputs["image_grid_thw"]
    video_grid = inputs.mm_inputs["video_grid_thw"]
    assert inputs.mm_spans[0].num_placeholder_tokens == int(image_grid.prod()) // merge
    assert inputs.mm_spans[1].num_placeholder_tokens == int(video_grid.prod()) // merge


def test_gemma_video_brings_its_audio_track(tiny_path, media):
    processor, decoder = worker(tiny_path, "gemma4")
    inputs = process_messages(processor, decoder, user(video(media["video_av"])))
    assert [s.modality for s in inputs.mm_spans] == ["video", "audio"]
    assert "input_features" in inputs.mm_inputs
    model = processor.adapter.load_model(tiny_path("gemma4")).eval()
    with torch.no_grad():
        model(**inputs.model_inputs())


def test_video_timestamps_come_from_the_real_frame_rate(tiny_path, media):
    processor, decoder = worker(tiny_path, "qwen3_5")
    inputs = process_messages(processor, decoder, user(video(media["video"])))
    text = processor.tokenizer.decode(inputs.input_ids)
    # 8 frames at 4 fps sampled at 2 fps -> frames 0, 2, 4, 6, grouped by 2: t = 0.25 s and 1.25 s.
    assert "<0.2 seconds>" in text or "<0.3 seconds>" in text
    assert "<1.2 seconds>" in text or "<1.3 seconds>" in text


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "minicpmv4_6", "qwen3_vl"])
def test_local_path_and_data_url_encode_identically(tiny_path, media, family):
    """Invariant 1: the same media reaches the same tensors whatever the source."""
    processor, decoder = worker(tiny_path, family)
    data = base64.b64encode(media["image"].read_bytes()).decode()
    by_path = process_messages(processor, decoder, user(image(media["image"])))
    by_data = process_messages(
        processor, decoder, user({"type": "image", "url": f"data:image/png;base64,{data}"})
    )
    assert by_path.input_ids == by_data.input_ids
    assert by_path.mm_inputs.keys() == by_data.mm_inputs.keys()
    for key, value in by_path.mm_inputs.items():
        assert torch.equal(value, by_data.mm_inputs[key]), key
    assert by_path.cache_key == by_data.cache_key


def test_split_path_matches_in_process_path(tiny_path, media):
    """Serving runs decode and encode in separate workers; the result must not differ."""
    processor, decoder = worker(tiny_path, "gemma4")
    messages = user(
        image(media["image"]), {"type": "audio_url", "audio_url": {"url": str(media["audio"])}}
    )
    joined = process_messages(processor, decoder, messages)
    other_decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    decoded = other_decoder.decode_many(processor.media_refs(messages))
    split = Processor(tiny_path("gemma4")).encode(messages, decoded)
    assert split.input_ids == joined.input_ids
    for key, value in joined.mm_inputs.items():
        assert torch.equal(value, split.mm_inputs[key]), key


def test_prompt_limit_names_encoded_length_and_limit(tiny_path, media):
    processor, decoder = worker(tiny_path, "gemma4", PromptLimits(max_prompt_tokens=50))
    with pytest.raises(PromptTooLongError, match=r"encodes to \d+ tokens.*--max-prompt-tokens=50"):
        process_messages(processor, decoder, user(image(media["image"])))


def test_context_limit_counts_requested_completion(tiny_path, media):
    processor, decoder = worker(tiny_path, "qwen3_5", PromptLimits(max_context_len=64))
    messages = user(image(media["image"]), {"type": "text", "text": "hi"})
    inputs = process_messages(processor, decoder, messages)
    n = inputs.num_prompt_tokens
    with pytest.raises(PromptTooLongError, match=rf"{n} in the encoded prompt.*at most {64 - n}"):
        process_messages(processor, decoder, messages, max_new_tokens=64)
    tight = worker(tiny_path, "qwen3_5", PromptLimits(max_context_len=n))
    with pytest.raises(PromptTooLongError, match="no room to generate"):
        process_messages(*tight, messages)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "gemma4", "minicpmv4_6"])
def test_clip_sampled_to_one_frame_still_encodes(tiny_path, tmp_path, family):
    # 2 frames at 4 fps, sampled at 2 fps: one frame, fewer than Qwen's temporal patch of 2.
    processor, decoder = worker(tiny_path, family)
    short = write_video(tmp_path / "short.mp4", seconds=0.5, fps=4.0)
    inputs = process_messages(processor, decoder, user(video(short)))
    assert inputs.num_tokens("video") > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_image_the_processor_refuses_is_a_4xx(tiny_path, tmp_path, family):
    processor, decoder = worker(tiny_path, family)
    strip = write_image(tmp_path / "strip.png", 4000, 1)
    with pytest.raises(UnprocessableMediaError, match=r"strip\.png.*aspect ratio") as info:
        process_messages(processor, decoder, user(image(strip)))
    assert info.value.status_code == 400


def test_unsupported_modality_is_refused_before_decoding(tiny_path, tmp_path):
    processor, decoder = worker(tiny_path, "qwen3_5")
    missing = tmp_path / "never-written.wav"
    with pytest.raises(UnsupportedModalityError, match="Qwen3.5.*audio"):
        process_messages(
            processor, decoder, user({"type": "audio_url", "audio_url": {"url": str(missing)}})
        )


def test_malformed_message_names_json_path(tiny_path):
    processor, decoder = worker(tiny_path, "qwen3_5")
    with pytest.raises(
        RequestValidationError, match=r"messages\[0\]\.content\[0\]\.image_url\.url"
    ):
        process_messages(processor, decoder, user({"type": "image_url", "image_url": {}}))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "minicpmv4_6"])
def test_tool_round_with_media_in_tool_result(tiny_path, media, family):
    processor, decoder = worker(tiny_path, family)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "crop",
                "description": "Crop the image.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        }
    ]
    messages = [
        *user(image(media["image"]), {"type": "text", "text": "zoom in"}),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "crop", "arguments": '{"x": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [image(media["image2"])]},
    ]
    inputs = process_messages(processor, decoder, messages, tools=tools)
    assert [s.modality for s in inputs.mm_spans] == ["image", "image"]
    assert '"x"' in inputs.prompt_text and "crop" in inputs.prompt_text
    model = processor.adapter.load_model(tiny_path(family)).eval()
    with torch.no_grad():
        model(**inputs.model_inputs())


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_an_encoded_prompt_crosses_processes_whole(tiny_path, media, family):
    """What Ray pickles between the Processor, the Ingress and the Generator: the same ids,
    spans and tensors (dtype, shape, values) come back, as writable tensors; a tensor NumPy has
    no dtype for stays a tensor."""
    import pickle

    processor, decoder = worker(tiny_path, family)
    messages = user(image(media["image"]), video(media["video"]), {"type": "text", "text": "hi"})
    prompt = process_messages(processor, decoder, messages)
    prompt.mm_inputs["extra"] = torch.ones(2, 3, dtype=torch.bfloat16)
    back = pickle.loads(pickle.dumps(prompt))
    assert back.input_ids == prompt.input_ids and back.mm_spans == prompt.mm_spans
    assert (
        back.prompt_text == prompt.prompt_text and back.mm_inputs.keys() == prompt.mm_inputs.keys()
    )
    for key, value in prompt.mm_inputs.items():
        assert isinstance(back.mm_inputs[key], torch.Tensor), key
        assert back.mm_inputs[key].dtype == value.dtype and torch.equal(back.mm_inputs[key], value)
        back.mm_inputs[key].add_(1)  # writable, and not the sender's memory
        assert not torch.equal(back.mm_inputs[key], value)


def test_a_groups_prompts_cross_processes_with_their_media_once(tiny_path, media):
    """A GRPO group's episodes share their prompt's media tensors: a pickle of them (a rollout
    worker's group, through Ray) holds each once, out of band as Ray sends it, and reads back
    one tensor the episodes share, copied out of the read-only buffer once."""
    import pickle

    processor, decoder = worker(tiny_path, "gemma4")
    messages = user(video(media["video"]), {"type": "text", "text": "hi"})
    prompt = process_messages(processor, decoder, messages)
    episodes = [prompt.with_tokens(prompt.input_ids + [i + 1]) for i in range(4)]
    buffers: list = []
    data = pickle.dumps(episodes, protocol=5, buffer_callback=buffers.append)
    alone: list = []
    pickle.dumps(prompt, protocol=5, buffer_callback=alone.append)
    per_token = sum(key.endswith("token_type_ids") for key in prompt.mm_inputs)
    # each media tensor once; the per-token ones, each episode's own
    assert len(buffers) == len(alone) + (len(episodes) - 1) * per_token
    back = pickle.loads(data, buffers=[buffer.raw().toreadonly() for buffer in buffers])
    for key, value in prompt.mm_inputs.items():
        if key.endswith("token_type_ids"):  # per token: each episode's own, one longer
            assert back[0].mm_inputs[key] is not back[1].mm_inputs[key]
            continue
        assert all(item.mm_inputs[key] is back[0].mm_inputs[key] for item in back), key
        assert torch.equal(back[0].mm_inputs[key], value)
        back[0].mm_inputs[key].add_(1)  # writable: a copy of the read-only buffer
    assert [item.input_ids for item in back] == [item.input_ids for item in episodes]
