"""Agent programs as rollouts: a program that speaks the OpenAI API (`rollout.program`) runs
against the rollout workers through a per-episode chat route that records every call as the
engine ran it; its episodes become trajectories (areno.rollout.calls)."""
