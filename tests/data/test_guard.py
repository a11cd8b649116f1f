"""The private data guard: a private value on a sample's public side fails its loading, naming
the sample, the key and the place, never the value; the shipped tasks and examples load."""

from __future__ import annotations

import pytest

from areno.data import Sample, load_samples
from areno.data.guard import PUBLIC_VALUES, PrivateDataLeakError, check_private

TOOL = {
    "type": "function",
    "function": {
        "name": "answer",
        "description": "Answer.",
        "parameters": {"type": "object", "properties": {"label": {"enum": ["violin", "drums"]}}},
    },
}


def _sample(text: str, url: str = "/data/clip-00001.mp4", tools=None, **private) -> Sample:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    return Sample([{"role": "user", "content": content}], tools=tools, private=private, id="s1")


def _call(arguments: str) -> dict:
    return {"id": "c0", "type": "function", "function": {"name": "answer", "arguments": arguments}}


def _with_turns(*turns: dict, **private) -> Sample:
    messages = [{"role": "user", "content": "Which instrument plays?"}, *turns]
    return Sample(messages, private=private, id="s1")


@pytest.mark.parametrize(
    ("sample", "key", "where"),
    [
        (_sample("Is this a Violin?", label="violin"), "label", "message 0's text"),
        (_sample("Which?", url="/data/train-00001-violin.mp4", label="violin"), "label", "media"),
        (_sample("Which?", tools=[TOOL], label="violin"), "label", "tool schemas"),
        (_sample("From 2.5 s on.", segment={"text": "2.5"}), "segment.text", "message 0's text"),
        (
            _sample("Which?", url="/d/a-red.png", color="red", **{PUBLIC_VALUES: ["red"]}),
            "color",
            "media",
        ),
        # numbers by their text, short values as whole words
        (_sample("The code is 1234; repeat it.", answer=1234), "answer", "message 0's text"),
        (_sample("Six times seven is 42.", answer="42"), "answer", "message 0's text"),
        (_sample("Pick A or B.", answer="A"), "answer", "message 0's text"),
        (_sample("It lasts 3 s.", duration=3.0), "duration", "message 0's text"),
        (_sample("Is it so? true or not", flag=True), "flag", "message 0's text"),
        # media references URL-decoded, split at camel-case and digit boundaries
        (_sample("Which?", url="/d/red%20car.png", label="red car"), "label", "media"),
        (_sample("Which?", url="/d/clipViolin01.png", label="violin"), "label", "media"),
        (_sample("Which?", url="/d/violin/clip-7.mp4", label="violin"), "label", "media"),
        (_sample("How many?", url="/d/count_5.png", count=5), "count", "media"),
        # every string of every message: an earlier turn's tool call, a tool's result
        (
            _with_turns(
                {"role": "assistant", "tool_calls": [_call('{"label": "violin"}')]},
                label="violin",
            ),
            "label",
            "message 1's tool_calls[0].function.arguments",
        ),
        (
            _with_turns(
                {"role": "assistant", "tool_calls": [_call("{}")]},
                {"role": "tool", "tool_call_id": "c0", "content": "The answer is 17."},
                answer=17,
            ),
            "answer",
            "message 2's text",
        ),
    ],
)
def test_a_private_value_on_the_public_side_fails_naming_sample_key_and_place(sample, key, where):
    with pytest.raises(PrivateDataLeakError) as caught:
        check_private(sample)
    message = str(caught.value)
    assert "'s1'" in message and f"private[{key!r}]" in message and where in message
    assert caught.value.param == key
    value = sample.private[key.split(".")[0]]
    value = value["text"] if isinstance(value, dict) else value
    if isinstance(value, str) and len(value) > 2:
        assert value not in message  # the value itself is not shown (errors are logged)


def test_values_public_by_design_and_parts_of_words_pass():
    check_private(
        _sample(
            "Classes: violin, drums. Which one plays?",
            tools=[TOOL],
            label="violin",
            **{PUBLIC_VALUES: ["violin", "drums"]},
        )
    )
    check_private(_sample("Pick A or B.", answer="A", **{PUBLIC_VALUES: ["A", "B"]}))
    check_private(_sample("A reddish tone.", color="red"))  # not a word of its own
    check_private(_sample("Which?", url="data:video/mp4;base64,cmVkIHJlZA==", color="red"))
    check_private(_sample("It lasts 3.5 s.", duration=3.0))  # 3.0 is not 3.5
    # a number in a media reference's directories, a short value inside a hash
    check_private(_sample("How many?", url="/runs/run-12/a.png", count=12))
    check_private(_sample("Which?", url="/d/train-3fa9c0b1e2.png", answer="B"))
    check_private(_sample("Which?", url="/test_a_run/train-1.png", answer="A"))  # a directory


def test_loading_runs_the_guard_on_every_sample(tmp_path):
    leak = _sample("It is a violin.", label="violin").to_json()
    (tmp_path / "train.jsonl").write_text(leak + "\n")
    with pytest.raises(PrivateDataLeakError, match="'s1'"):
        list(load_samples("areno.data.loader:jsonl", path=str(tmp_path), split="train"))


def test_the_shipped_tasks_and_examples_load_without_a_leak(tmp_path):
    from examples.multimodal.ave_event_recognition.generate_dataset import make_split
    from examples.vl.compare import generate_dataset as compare
    from examples.vl.counting import generate_dataset as counting

    quiz = list(load_samples("areno.tasks.color_quiz:load", num_samples=8, media_dir=tmp_path))
    assert len(quiz) == 8
    for sample in quiz:
        (part, _) = sample.messages[0]["content"]
        assert sample.private["color"] not in part["image_url"]["url"]
    ave = make_split(
        tmp_path / "ave", "train", 4, seed=0, seconds=2.0, fps=2.0, size=32, data_urls=False,
        progress=False,
    )  # fmt: skip
    assert len(list(load_samples("areno.data.loader:jsonl", path=str(ave)))) == 4
    for module in (compare, counting):
        out = tmp_path / module.__name__.rsplit(".", 2)[-2]
        module.main(
            ["--out", str(out), "--num-train", "4", "--num-validation", "2", "--no-progress"]
        )
        samples = load_samples("areno.data.loader:jsonl", path=str(out), split="train")
        assert len(list(samples)) == 4
