"""Which rollout component an online run uses: chosen once, from its config and what the Python API was given."""

from __future__ import annotations

from rlhfkit.rollout import RolloutMaker
from rlhfkit.rollout.single_turn import SingleTurn


def rollout_maker(cfg, tokenizer, objects) -> RolloutMaker:
    """The rollout component of an online run (`cfg`: its config; `objects`: what the Python API was given): one
    assistant turn per sample; `objects.rollout`, when given, is called with it and returns the component to use."""
    made = SingleTurn(tokenizer, cfg.generation, cfg.seed)
    return objects.rollout(made) if objects.rollout is not None else made
