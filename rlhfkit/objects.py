"""What a run takes from Python besides its config: objects the caller already holds (`rlhfkit.train`).

The config still names everything (and is saved with the run as `config.yaml`); an object given here replaces what
the config's name would have loaded: the policy model and its tokenizer, the reward sources in the caller's order,
and transformers `TrainerCallback`s. Every field may stay empty: the CLI passes none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Objects:
    # A transformers PreTrainedModel: the policy (or the reward model being trained by `rlhfkit rm`), trained in place.
    model: Any = None
    tokenizer: Any = None  # its tokenizer (a pad token is added when it has none, as for a loaded one)
    # The reward sources of a sampling stage, in the caller's order (the order of `reward.weights`): Python
    # callables under TRL's contract, "module:function" names, reward-model directories, or sequence-classification
    # model objects. Empty: the sources the config names.
    reward_funcs: tuple = ()
    reward_weights: tuple | None = None  # one per entry of `reward_funcs`; None: 1 each
    callbacks: tuple = ()  # transformers TrainerCallback objects (or classes), called at the run's events
    # The online stages' rollout component (`rlhfkit.rollout.RolloutMaker`: prompts in, a `Rollout` out), as a function
    # of the one the config would use: wrap it (a scripted or filtered rollout) or return your own. None: the config's.
    rollout: Any = None
