"""SampleStream: deterministic epochs, wrap-around batches, and exact resumption."""

from __future__ import annotations

import random

import pytest

from areno.data import Sample, SampleStream
from areno.errors import ConfigError

SAMPLES = [Sample(messages=[{"role": "user", "content": str(i)}], id=str(i)) for i in range(7)]


def ids(batch: list[Sample]) -> list[str]:
    return [s.id for s in batch]


def test_epochs_are_permutations_reshuffled_by_seed_plus_epoch():
    stream = SampleStream(SAMPLES, seed=3)
    first, second = ids(stream.next_batch(7)), ids(stream.next_batch(7))
    assert sorted(first) == sorted(second) == [str(i) for i in range(7)]
    expected = []
    for epoch in (0, 1):
        order = list(range(7))
        random.Random(3 + epoch).shuffle(order)
        expected.append([str(i) for i in order])
    assert [first, second] == expected
    assert stream.position == 14 and stream.epoch == 2


def test_batches_wrap_across_epochs():
    stream = SampleStream(SAMPLES, seed=0, shuffle=False)
    assert ids(stream.next_batch(5)) == ["0", "1", "2", "3", "4"]
    assert ids(stream.next_batch(5)) == ["5", "6", "0", "1", "2"]
    assert stream.position == 10 and stream.epoch == 1


def test_same_seed_same_stream_other_seed_other_order():
    a, b, c = (SampleStream(SAMPLES, seed=s) for s in (11, 11, 12))
    batches_a = [ids(a.next_batch(3)) for _ in range(10)]
    assert batches_a == [ids(b.next_batch(3)) for _ in range(10)]
    assert batches_a != [ids(c.next_batch(3)) for _ in range(10)]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5, 9])
def test_resume_matches_uninterrupted(stop_after):
    k, total = 3, 12  # batches of 3 over 7 samples: resumption points fall mid-epoch too
    whole = SampleStream(SAMPLES, seed=5)
    expected = [ids(whole.next_batch(k)) for _ in range(total)]

    first = SampleStream(SAMPLES, seed=5)
    got = [ids(first.next_batch(k)) for _ in range(stop_after)]
    resumed = SampleStream(SAMPLES, seed=5, start_position=first.position)
    got += [ids(resumed.next_batch(k)) for _ in range(total - stop_after)]
    assert got == expected
    assert resumed.position == whole.position == k * total


def test_iterates_and_ignores_later_changes_to_the_list():
    samples = list(SAMPLES)
    stream = SampleStream(samples, seed=1, shuffle=False)
    samples.clear()
    assert [next(stream).id for _ in range(8)] == ["0", "1", "2", "3", "4", "5", "6", "0"]
    assert stream.num_samples == 7


def test_bad_arguments():
    with pytest.raises(ConfigError, match="dataset is empty"):
        SampleStream([], seed=0)
    with pytest.raises(ConfigError, match="start_position must be an int >= 0"):
        SampleStream(SAMPLES, seed=0, start_position=-1)
    stream = SampleStream(SAMPLES, seed=0)
    for k in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="batch size must be an int >= 1"):
            stream.next_batch(k)
