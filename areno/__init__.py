"""AReno: serve and RL-train multimodal Hugging Face checkpoints on Ray."""

__version__ = "0.1.0"
