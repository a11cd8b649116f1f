"""One OpenMP thread pool for the engine thread (CPU).

torch's CPU kernels run their parallel regions on libgomp, which keeps a pool of worker threads
for each thread that has opened a region. When all pools together hold more threads than the
process may use CPUs, libgomp stops letting idle workers spin between regions ("throttled"
spinning), so every region of every pool pays a futex wake-up. A decode step opens hundreds of
regions. The Generator builds its model in one thread (the caller's, or a Serve replica's) and
steps it in its own engine thread, which made two pools: on the 2-core CI machine a 16-row decode
step of the small Qwen3.5 checkpoint took 22-26 ms from the engine thread against 17 ms from the
thread that built it, and 17.8 ms once that thread's idle pool was released.

`release_thread_pool()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`,
hard pause). A thread that opens a region again later gets a new pool. Builds of torch on another
OpenMP runtime (Intel's, LLVM's) are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # the loaded library itself: same path, same handle
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's libgomp worker threads. Returns whether a libgomp was found and
    agreed (it refuses inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    released = lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
    if not released:
        logger.debug("libgomp kept this thread's OpenMP pool (omp_pause_resource_all refused)")
    return released
