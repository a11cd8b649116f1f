"""One Ray instance and one Serve HTTP proxy on loopback for every module of this folder: the
tests that drive a live `areno serve` app. Each module deploys its own apps into it under names
of its own and deletes them when it ends (so `/` is free again for the next one); a module that
injects faults kills only its own app's replicas. Starting Ray with Serve's controller and
proxy took about 7 s on a 2-core machine and stopping them 2 to 7 s more, once per module; the
folder now pays it once. The instance stops with the folder's last test, before any other test
starts a Ray of its own (`areno demo`, the training tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import ray
from ray import serve

from tests.serve.live import apps

# Logical CPUs of the test instance, as each module's own instance had: apps are deleted with
# their module, so the most held at once is still one module's (the Gemma 4 app and its guarded
# twin, 1.75 each, beside a third that never gets its Generator).
NUM_CPUS = 4


@pytest.fixture(scope="package")
def serve_port() -> Iterator[int]:
    """The port of the Serve HTTP proxy on 127.0.0.1; Ray and Serve stop after the folder's
    last test. Every replica logs its completions (ARENO_LOG_COMPLETIONS=1, read at worker start,
    so set before Ray starts) and treats apps.PUBLIC_STAND_IN as a public host."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    saved_log = os.environ.get("ARENO_LOG_COMPLETIONS")
    os.environ["ARENO_LOG_COMPLETIONS"] = "1"
    port = apps.free_port()
    ray.cloudpickle.register_pickle_by_value(sys.modules[apps.__name__])
    try:
        ray.init(
            address="local",  # never a cluster another process started on this machine
            num_cpus=NUM_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"worker_process_setup_hook": apps.public_stand_in},
        )
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[apps.__name__])
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved_log is None:
            os.environ.pop("ARENO_LOG_COMPLETIONS", None)
        else:
            os.environ["ARENO_LOG_COMPLETIONS"] = saved_log
