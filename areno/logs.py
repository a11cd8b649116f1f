"""`ARENO_LOG_COMPLETIONS=1`: one log line per completion, in serving (one per request) and in
rollouts (one per turn of an episode, with its parsed tool calls and what they returned)."""

from __future__ import annotations

import logging
import os
import sys

ENV = "ARENO_LOG_COMPLETIONS"


def completions_logged() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0", "false")


def stderr_logger(name: str) -> logging.Logger:
    """A logger that writes INFO lines to stderr (which Ray forwards from an actor to the
    driver's console) whatever the process's logging setup; propagates as usual."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger
