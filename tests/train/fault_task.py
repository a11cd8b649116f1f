"""The color quiz with injected crashes, for tests/train/test_faults.py.

A process crash is injected at an exact point of a run, so the test does not race the run's
timing: the process that makes the `kill_at_call`-th call of a hook SIGKILLs itself, the way
the kernel's OOM killer or a lost node ends a worker (no exception, no cleanup). Each crash
happens once: it first claims (deletes) its marker file, so the restarted process, whose call
count starts again, runs on.

- `agent`: its `prompt_messages` runs in the rollout worker at the start of every group: a crash
  there loses the rollout worker mid-rollout.
- `reward`: runs in trainer rank 0 after the step's rollout: a crash there loses a trainer
  worker mid-step.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from areno.rollout.agent import Agent
from areno.rollout.trajectory import Trajectory
from areno.tasks import color_quiz

_lock = threading.Lock()
_num_reward_calls = 0


def _crash_once(marker: str) -> None:
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return  # already crashed once
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class CrashingAgent(Agent):
    """A plain single-turn answerer whose process dies at its `kill_at_call`-th group."""

    marker: str = ""
    kill_at_call: int = 1
    _num_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def prompt_messages(self, messages: Sequence[dict]) -> list[dict]:
        with self._lock:
            self._num_calls += 1
            due = self._num_calls >= self.kill_at_call
        if due:
            _crash_once(self.marker)
        return super().prompt_messages(messages)


def agent(marker: str, kill_at_call: int) -> CrashingAgent:
    return CrashingAgent(marker=marker, kill_at_call=kill_at_call)


def reward(
    trajectory: Trajectory, private: dict, *, marker: str, kill_at_call: int
) -> dict[str, float]:
    """The color quiz's reward, in a process that dies at its `kill_at_call`-th call."""
    global _num_reward_calls
    with _lock:
        _num_reward_calls += 1
        due = _num_reward_calls >= kill_at_call
    if due:
        _crash_once(marker)
    return color_quiz.reward(trajectory, private)


def unstartable_agent(**_) -> Agent:
    """An agent that cannot be built where the rollout worker runs (a tool server it cannot
    reach there, say): importable in the driver, failing on the worker."""
    raise RuntimeError("the sandbox this agent needs is not reachable from this rollout worker")
