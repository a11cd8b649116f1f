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
    assert value not in message  # the value itself is not shown (errors are logged)


def test_values_public_by_design_short_ones_and_parts_of_words_pass():
    check_private(
        _sample(
            "Classes: violin, drums. Which one plays?",
            tools=[TOOL],
            label="violin",
            **{PUBLIC_VALUES: ["violin", "drums"]},
        )
    )
    check_private(_sample("Pick A or B.", answer="A"))  # shorter than 3 characters
    check_private(_sample("A reddish tone.", color="red"))  # not a word of its own
    check_private(_sample("Which?", url="data:video/mp4;base64,cmVkIHJlZA==", color="red"))


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
