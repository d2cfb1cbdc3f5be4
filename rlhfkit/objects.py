"""What a run takes from Python besides its config: objects the caller already holds (`rlhfkit.train`).

The config still names everything (and is saved with the run as `config.yaml`); an object given here replaces what
the config's name would have loaded: the policy model and its tokenizer, the reward sources in the caller's order,
transformers `TrainerCallback`s, tools and environments. Every field may stay empty: the CLI passes none.
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
    # TRL's `tools` and `environment_factory` (`rlhfkit.tools`): callables the policy may call, and a class (or a dict
    # name -> class) making each episode's environment. Empty: the config's tools.functions / tools.environment.
    tools: tuple = ()
    environment_factory: Any = None
    # The run's `tools.Toolbox`, made once when the run starts (`stages.trainer_of`) from the two above or the config's
    # names; None without tools. The rollout component and the environments' reward sources share it.
    toolbox: Any = None
