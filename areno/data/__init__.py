"""Training data: samples with private reward data, loaders named by import path, and a
deterministic, resumable sample stream.

Only `Sample.public()` may be sent to rollout workers, tool environments or logs; `Sample.private`
is for the reward function alone.
"""

from __future__ import annotations

from areno.data.loader import BUILTIN_LOADERS, Loader, jsonl, load_samples, resolve_loader
from areno.data.sample import REDACTED, PublicSample, Sample, SampleError
from areno.data.stream import SampleStream

__all__ = [
    "BUILTIN_LOADERS",
    "REDACTED",
    "Loader",
    "PublicSample",
    "Sample",
    "SampleError",
    "SampleStream",
    "jsonl",
    "load_samples",
    "resolve_loader",
]
