"""rlhfkit: align language models with human preferences (SFT, reward models, online RL, preference optimisation)."""

__version__ = "0.1.0"
