"""A deterministic, resumable stream of training samples over a finite dataset.

The order of epoch `e` is a function of `(seed, e)` alone, so the stream's whole future follows
from `position` (the number of samples consumed): a checkpoint stores that one int, and
`SampleStream(samples, seed, start_position=p)` continues exactly where the run stopped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from areno.data.sample import Sample
from areno.errors import ConfigError


class SampleStream:
    """Samples in epochs, reshuffled each epoch with `random.Random(seed + epoch)`.

    Args:
        samples: the dataset; copied, so later changes to the caller's list do not move it.
        seed: the shuffle seed.
        shuffle: False keeps the dataset order in every epoch.
        start_position: samples already consumed (a resumed run's `position`).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        seed: int,
        shuffle: bool = True,
        *,
        start_position: int = 0,
    ) -> None:
        self._samples = tuple(samples)
        if not self._samples:
            raise ConfigError("SampleStream needs at least one sample; the dataset is empty")
        if (
            not isinstance(start_position, int)
            or isinstance(start_position, bool)
            or start_position < 0
        ):
            raise ConfigError(f"start_position must be an int >= 0, got {start_position!r}")
        self._seed = seed
        self._shuffle = shuffle
        self._position = start_position
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def position(self) -> int:
        """Samples consumed so far, across epochs (what a checkpoint stores)."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from (0-based)."""
        return self._position // len(self._samples)

    @property
    def num_samples(self) -> int:
        """Samples in one epoch."""
        return len(self._samples)

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them."""
        order = list(range(len(self._samples)))
        if self._shuffle:
            random.Random(self._seed + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[Sample]:
        return self

    def __next__(self) -> Sample:
        epoch, offset = divmod(self._position, len(self._samples))
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        self._position += 1
        return self._samples[self._order[offset]]

    def next_batch(self, k: int) -> list[Sample]:
        """The next `k` samples, continuing into the next epoch when this one runs out."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"batch size must be an int >= 1, got {k!r}")
        return [next(self) for _ in range(k)]
