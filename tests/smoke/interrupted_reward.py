"""`rlhfkit.tasks.toy:vowel_reward` under the same name (so a run logs the same `rewards/vowel_reward/*` keys), with a
Ctrl-C when asked to score step 4: loaded as `tests.smoke.interrupted_reward:vowel_reward`, it kills a run after
step 3 through the public reward-function contract (`trainer_state.global_step` is the 0-based step)."""

from rlhfkit.tasks import toy


def vowel_reward(prompts, completions, trainer_state=None):
    if trainer_state.global_step == 3:
        raise KeyboardInterrupt
    return toy.vowel_reward(prompts, completions)
