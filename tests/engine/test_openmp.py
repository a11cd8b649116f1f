"""The engine thread's OpenMP pool: release_thread_pool frees the calling thread's workers."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from areno.engine.openmp import _libgomp, release_thread_pool


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(_libgomp() is None, reason="torch here does not run on libgomp")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread opens no pool")
def test_release_frees_the_calling_threads_openmp_workers():
    seen = {}

    def in_a_fresh_thread():
        before = _os_threads()
        torch.ones(1 << 22).mul_(2)  # large enough to open a parallel region: a new pool
        seen["with_pool"] = _os_threads()
        seen["released"] = release_thread_pool()
        deadline = time.monotonic() + 10
        while _os_threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers exit on their own after the pause
        seen["after"] = _os_threads()
        seen["before"] = before

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert seen["with_pool"] == seen["before"] + torch.get_num_threads() - 1
    assert seen["released"]
    assert seen["after"] == seen["before"]
