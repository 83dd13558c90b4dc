"""vime: fully asynchronous RL post-training for LLMs over a ZeroMQ pipeline."""

__version__ = "0.1.0"
