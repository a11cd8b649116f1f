"""The engine thread's OpenMP pool: release_thread_pool frees the calling thread's workers."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from areno.engine.openmp import _libgomp, release_thread_pool


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(_libgomp() is None, reason="torch here does not run on libgomp")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread opens no pool")
def test_release_frees_the_calling_threads_openmp_workers():
    # By thread id, not count: other threads of the test session may come and go meanwhile.
    workers = torch.get_num_threads() - 1
    seen = {}

    def in_a_fresh_thread():
        before = _os_threads()
        torch.ones(1 << 22).mul_(2)  # large enough to open a parallel region: a new pool
        seen["new"] = _os_threads() - before
        seen["released"] = release_thread_pool()
        deadline = time.monotonic() + 10
        while len(seen["new"] & _os_threads()) > len(seen["new"]) - workers:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # the workers exit on their own after the pause
        seen["left"] = seen["new"] & _os_threads()

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert len(seen["new"]) >= workers  # the pool's workers appeared with the region
    assert seen["released"]
    assert len(seen["left"]) <= len(seen["new"]) - workers  # and left with the release
