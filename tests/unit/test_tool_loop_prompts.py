"""What reward sources get as `prompts` from an episode whose environment's `reset()` returned text: the prompt as
played, the text appended to its last message (TRL 1.16 passes its modified prompts to reward functions), while the
record's own prompt is left as it was."""

import torch

from rlhfkit.rewards import reward_inputs
from tests.unit.test_tool_loop import Vault, run, tiny  # noqa: F401 (tiny: the module's fixture)


def test_reward_functions_get_the_prompt_with_the_environments_observation(tiny):  # noqa: F811
    _, tok = tiny
    prompts = [([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], {"secret": 3}),
               ([{"role": "user", "content": "hi"}], {"secret": 5})]
    ro, examples = run(tiny, prompts, tools=[], env=Vault)
    seen = reward_inputs(tok, ro, examples).prompts
    assert seen == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello [vault 3]"}],
                    [{"role": "user", "content": "hi [vault 5]"}]]
    assert examples[0]["prompt"][-1] == {"role": "user", "content": "hello"}  # the record is untouched
    # Selecting rows keeps each row's own prompt.
    picked = reward_inputs(tok, ro.select(torch.tensor([1])), examples[1:]).prompts
    assert picked == [[{"role": "user", "content": "hi [vault 5]"}]]


def test_without_an_environment_the_records_prompt_is_passed_as_is(tiny):  # noqa: F811
    _, tok = tiny
    ro, examples = run(tiny, ["add 1 2"])
    assert reward_inputs(tok, ro, examples).prompts == ["add 1 2"]


def test_a_text_prompt_gets_the_observation_appended_as_text(tiny):  # noqa: F811
    _, tok = tiny
    ro, examples = run(tiny, [("hello", {"secret": 4})], tools=[], env=Vault)
    assert reward_inputs(tok, ro, examples).prompts == ["hello [vault 4]"]
