"""A reward model scores a tool episode whole: the assistant's calls and the tool results, not only the text turns.

The policy's tokenizer carries the bundled `chatml_tools` template (`model.chat_template`); a reward model with a
template of its own re-tokenises the conversation (`RewardModelSource.encode`). The tiny tokenizer's own template, like
SmolLM2's, renders each turn's content only, so it would drop the calls: the episode is then rendered with the
policy's template (warned once). A template of the reward model's own that renders them is kept; a conversation that
no template at hand renders whole is refused in one line.
"""

import dataclasses
import logging

import pytest
import torch

from rlhfkit import templates
from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.reward_functions import RewardInputs
from rlhfkit.rewards import RewardModelScorer, RewardModelSource, reward_inputs
from rlhfkit.types import Rows
from tests.unit.test_reward_functions import rollout

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
EPISODE = [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "name": "add", "content": "5"},
           {"role": "assistant", "content": "It is 5."}]
# The episode as chatml_tools renders it, by hand.
EPISODE_TEXT = ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
                '<|im_end|>\n<|im_start|>tool\n<tool_response name="add">\n5\n</tool_response><|im_end|>\n'
                '<|im_start|>assistant\nIt is 5.<|im_end|>\n')
PROMPT_TEXT = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
# A reward model's own template that renders calls and results its own way.
OWN_TOOLS_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% if m.tool_calls is defined %}"
                      "{% for c in m.tool_calls %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>"
                      "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


class Recorder:
    """A reward model's forward that scores each row by its length, keeping what it read."""

    def __init__(self, tokenizer):
        self.tokenizer, self.read = tokenizer, []

    def __call__(self, ids, mask, response_mask):
        self.read += [(row[m.bool()].tolist(), r[m.bool()].tolist()) for row, m, r in zip(ids, mask, response_mask)]
        return mask.sum(-1).float()


@pytest.fixture()
def policy_tok():
    tok = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tok)
    return tok


def score(policy_tok, rm_tok, prompts):
    """The reward model with tokenizer `rm_tok` on one episode per prompt (a text or a message list): what it read."""
    scorer = Recorder(rm_tok)
    source = RewardModelSource(scorer, "rm", policy_tok)
    ro = dataclasses.replace(rollout(policy_tok, ["q"] * len(prompts), ["x"] * len(prompts)),
                             completions=Rows([EPISODE] * len(prompts)))
    inputs = reward_inputs(policy_tok, ro)
    source.score(ro, RewardInputs(prompts, inputs.completions, inputs.completion_ids, {}, None, None, None))
    return [(rm_tok.decode(ids), rm_tok.decode([t for t, r in zip(ids, resp) if r])) for ids, resp in scorer.read]


def test_a_template_that_drops_tool_calls_gives_way_to_the_policys(policy_tok, caplog):
    """The tiny tokenizer's own template (SmolLM2-like) would render the call turn as an empty assistant turn: the
    reward model reads the episode as chatml_tools renders it instead, a text prompt as one user turn."""
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        read = score(policy_tok, build_tiny_tokenizer(), ["What is 2 + 3?", [{"role": "user", "content": "What is 2 + 3?"}]])
    header = "<|im_start|>assistant\n"  # the prompt's generation prompt: the response is what follows it
    assert read == [(PROMPT_TEXT + EPISODE_TEXT, EPISODE_TEXT.removeprefix(header))] * 2
    warned = [r.message for r in caplog.records if "reward model 'rm'" in r.message]
    assert warned == ["reward model 'rm': its chat template does not render tool calls and results, so tool episodes "
                      "are rendered for it with the policy's chat template (model.chat_template)"]


def test_a_template_of_its_own_that_renders_tools_is_kept(policy_tok):
    own = build_tiny_tokenizer()
    own.chat_template = OWN_TOOLS_TEMPLATE
    ((text, response),) = score(policy_tok, own, ["What is 2 + 3?"])
    episode = '[assistant] <call add {"a": 2, "b": 3}>\n[tool] 5\n[assistant] It is 5.\n'
    assert (text, response) == ("[user] What is 2 + 3?\n" + episode, episode.removeprefix("[assistant] "))


def test_an_episode_no_template_renders_whole_is_refused(policy_tok):
    """The policy's template drops the calls too (a run without tools whose reward model is asked about one)."""
    policy_tok.chat_template = build_tiny_tokenizer().chat_template
    own = build_tiny_tokenizer()
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # another template, no tools either
    with pytest.raises(UserError) as caught:
        score(policy_tok, own, ["What is 2 + 3?"])
    assert str(caught.value) == (
        "reward model 'rm': neither its chat template nor the policy's renders tool calls and results, so it cannot "
        "read the episodes whole; set model.chat_template: chatml_tools (or save the reward model with a template "
        "that renders them)")


def test_a_reward_model_scores_the_episode_with_a_real_forward(policy_tok, tmp_path):
    """A tiny reward model with its own (tool-less) template: its score of an episode is its forward on the episode as
    chatml_tools renders it, by hand."""
    from tests.unit.test_reward_functions import save_rm

    from rlhfkit.rewards import load_reward_scorer

    path = save_rm(tmp_path / "rm", build_tiny_tokenizer())
    scorer = load_reward_scorer(path)
    source = RewardModelSource(scorer, "rm", policy_tok)
    assert source.retokenize
    ro = dataclasses.replace(rollout(policy_tok, ["q"], ["x"]), completions=Rows([EPISODE]))
    inputs = reward_inputs(policy_tok, ro)
    values, _ = source.score(ro, RewardInputs(["What is 2 + 3?"], inputs.completions, inputs.completion_ids, {}, None,
                                              None, None))
    ids = torch.tensor([scorer.tokenizer(PROMPT_TEXT + EPISODE_TEXT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = scorer.model(input_ids=ids).logits[0, 0]
    torch.testing.assert_close(values[0], expected, atol=1e-5, rtol=0)
