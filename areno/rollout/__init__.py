"""Rollout: the agent loop that turns a public Sample into a Trajectory on the serving classes.

`run_episode` is a small async workflow (generate -> parse tool calls -> run tools -> append
their results -> repeat); `RolloutWorker` hosts the very MediaDecoder / Processor / Generator
classes that serving deploys and runs episodes next to them.
"""

from areno.rollout.agent import Agent, ToolContext, ToolError, load_agent
from areno.rollout.episode import EpisodeLimits, run_episode
from areno.rollout.trajectory import ToolCallRecord, Trajectory

__all__ = [
    "Agent",
    "EpisodeLimits",
    "ToolCallRecord",
    "ToolContext",
    "ToolError",
    "Trajectory",
    "load_agent",
    "run_episode",
]
