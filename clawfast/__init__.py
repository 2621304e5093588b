"""clawfast: reinforcement learning for LLM agents through real, unmodified harnesses."""

__version__ = "0.1.0"
