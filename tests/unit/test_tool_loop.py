"""The multi-turn tool loop (`rollout.tool_loop.ToolLoop`) against hand-rendered episodes on the tiny model (one
character, one token) with the bundled `chatml_tools` template.

The policy is the tiny model steered by `script` (`tests.scripted.Scripted`): its logits plus BIAS on the token the
script wants next, sampled with top_k=1, so the episode is fixed while the log-probs stay the model's. The script
reads only the tokens a forward is given: a prefill or the chunk appended after a turn (prompt, or tool results and
header).
"""

import re

import pytest
import torch

from rlhfkit import templates
from rlhfkit.config import GenerationConfig, ModelConfig, RewardConfig
from rlhfkit.errors import TemplateError, UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.rewards import Rewards, reward_inputs
from rlhfkit.rollout.tool_loop import ToolLoop, tool_suffix
from rlhfkit.tools import Toolbox
from rlhfkit.types import PromptBatch, ToolCounts, ToolFigures
from tests.scripted import Scripted
from tests.smoke.agent_tools import add, fail, inc, recording

BIAS = 8.0
END = "<|im_end|>"


def call(name: str, **arguments) -> str:
    args = ", ".join(f'"{k}": {v}' for k, v in arguments.items())
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{{args}}}}}\n</tool_call>{END}'


def script(text: str) -> str:
    """The turn the policy writes after reading `text` (its prompt, or the last tool results and header)."""
    if results := re.findall(r"<tool_response name=\"(\w+)\">\n(.*?)\n</tool_response>", text, re.S):
        name, last = results[-1]
        if name == "inc" and last.isdigit():  # a policy that never stops calling (while its calls work)
            return call("inc", n=int(last))
        return f"got {last}{END}"
    ask = re.search(r"user\n(.*?)<\|im_end\|>", text, re.S).group(1)
    if ask.startswith("add "):
        a, b = ask.split()[1:3]
        return call("add", a=a, b=b)
    if ask.startswith("raw "):  # the rest is written as is
        return ask[4:] + END
    return f"no tool{END}"


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(name_or_path="tiny")
    tok = load_tokenizer(cfg)
    templates.load("chatml_tools").apply_to(tok)
    model = load_causal_lm(cfg, tok).eval()
    # The tools' schemas make prompts of ~800 characters, one token each: room for whole episodes past the tiny
    # model's 1024 (Llama's rotary positions work at any length; only the loop's limit reads this).
    model.config.max_position_embeddings = 4096
    return model, tok


def run(tiny, prompts, tools=(add, fail), env=None, max_new_tokens=200, max_calls=3, timeout_s=2.0,
        max_result_tokens=100, num_samples=1, top_k=1, seed_per_prompt=False, step=0, box=None, stop_strings=(),
        max_batch_rows=None, bias=BIAS):
    model, tok = tiny
    params = GenerationConfig(max_new_tokens=max_new_tokens, num_samples=num_samples, top_k=top_k,
                              seed_per_prompt=seed_per_prompt, stop_strings=list(stop_strings),
                              max_batch_rows=max_batch_rows)
    box = box or Toolbox(list(tools), env)
    loop = ToolLoop(tok, params, 0, box, max_calls, timeout_s, max_result_tokens)
    examples = [{"prompt": p[0], "columns": p[1]} if isinstance(p, tuple) else {"prompt": p, "columns": {}}
                for p in prompts]  # a prompt, or (prompt, its record's other fields)
    ids = [tok(str(e["prompt"]), add_special_tokens=False)["input_ids"] for e in examples]
    width = max(map(len, ids))
    batch = PromptBatch(torch.tensor([[0] * (width - len(x)) + x for x in ids]),
                        torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))
    return loop(Scripted(model, tok, script, bias), batch, examples, step), examples


def tool_turn(name, content):
    return f"\n<|im_start|>tool\n<tool_response name=\"{name}\">\n{content}\n</tool_response>{END}\n<|im_start|>assistant\n"


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def row(ro, i, tensor):
    return tensor[i][ro.response_mask[i].bool()].tolist()


def test_episodes_masks_and_completions_match_hand_rendered_ones(tiny):
    """Three episodes in one batch: a call then an answer, a direct answer, a call whose tool raises. The completion
    is the turns and the rendered tool results; only the turns are actions, with the sampler's log-probs."""
    _, tok = tiny
    ro, examples = run(tiny, [[{"role": "user", "content": "add 2 3"}], "hello", "raw " + call("fail", x=1)[:-len(END)]])
    turn1, result, turn2 = call("add", a=2, b=3), tool_turn("add", "5"), f"got 5{END}"
    error = str({"error": "ValueError: boom"})
    expected = [(turn1, result, turn2), (f"no tool{END}", "", ""), (call("fail", x=1), tool_turn("fail", error),
                                                                     f"got {error}{END}")]
    for i, (first, tool, second) in enumerate(expected):
        assert row(ro, i, ro.response_ids) == ids(tok, first + tool + second), i
        assert row(ro, i, ro.action_mask) == [1] * len(ids(tok, first)) + [0] * len(ids(tok, tool)) + [1] * len(
            ids(tok, second)), i
        on, off = ro.action_mask[i].bool(), ~ro.action_mask[i].bool()
        assert (ro.sampler_logprobs[i][off] == 0).all() and (ro.sampler_logprobs[i][on] < 0).all()
    assert ro.has_eos.tolist() == [True, True, True]
    rendered = tok.apply_chat_template([{"role": "user", "content": "add 2 3"}], tools=[Toolbox([add, fail]).functions[n].schema
                                                                                      for n in ("add", "fail")],
                                       tokenize=False, add_generation_prompt=True)
    assert tok.decode(ro.prompt_ids[0][ro.prompt_mask[0].bool()]) == rendered
    assert list(ro.completions) == [
        [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
         {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "got 5"}],
        [{"role": "assistant", "content": "no tool"}],
        [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "fail", "arguments": {"x": 1}}}]},
         {"role": "tool", "name": "fail", "content": error}, {"role": "assistant", "content": f"got {error}"}]]
    assert ro.texts[1] == "no tool"
    counts = ro.tools
    assert counts.tool_names == ("add", "fail")
    assert (counts.calls.tolist(), counts.failures.tolist(), counts.timeouts.tolist(), counts.malformed.tolist(),
            counts.turns.tolist(), counts.per_tool.tolist()) == ([1, 0, 1], [0, 0, 1], [0, 0, 0], [0, 0, 0], [2, 1, 2],
                                                                 [[1, 0], [0, 0], [0, 1]])
    # What reward functions receive: the episodes as TRL passes them, and the prompts as the dataset holds them.
    inputs = reward_inputs(tok, ro, examples)
    assert inputs.completions == list(ro.completions) and inputs.prompts[1] == "hello"
    assert inputs.completion_ids[0] == ids(tok, turn1 + result + turn2)


def test_sampler_logprobs_equal_a_full_forward_of_the_episode(tiny):
    """The KV cache kept across turns (rows dropped, columns masked) gives each token the log-prob a forward of the
    whole sequence gives it: the cached loop reads what a re-prefill would."""
    model, tok = tiny
    # Turns and results of different lengths: the shorter rows' caches hold columns that are not theirs.
    ro, _ = run(tiny, ["add 1 2", "hello", [{"role": "user", "content": "add 400 500"}]])
    full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_ids.shape[1] - 1:-1]
    bias = BIAS * torch.nn.functional.one_hot(ro.response_ids, full.shape[-1])
    expected = torch.log_softmax(full.float() + bias, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    mask = ro.action_mask.bool()
    assert mask.sum() > 100 and (ro.action_mask != ro.response_mask).any()
    torch.testing.assert_close(ro.sampler_logprobs[mask], expected[mask], rtol=1e-5, atol=1e-7)


def test_malformed_calls_are_counted_and_never_run(tiny):
    """A turn that does not parse ends its episode (one malformed); an unknown tool or arguments that do not fit the
    schema are answered with the error as the tool result and the episode goes on; none of them runs."""
    ran = []
    note = recording(ran)

    broken = '<tool_call>\n{"name": "note", "arguments": {"x": 1,}\n</tool_call>'
    ro, _ = run(tiny, ["raw " + broken, "raw " + call("nope", x=1)[:-len(END)], "raw " + call("note", x='"a"')[:-len(END)]],
                tools=[note], max_new_tokens=400)
    assert ran == []
    assert ro.tools.malformed.tolist() == [1, 1, 1] and ro.tools.calls.tolist() == [0, 0, 0]
    assert ro.tools.failures.tolist() == [0, 0, 0] and ro.tools.turns.tolist() == [1, 2, 2]
    assert ro.completions[0] == [{"role": "assistant", "content": broken}]
    assert ro.completions[1][1] == {"role": "tool", "name": "nope", "content": str({"error": "unknown tool 'nope' (tools: note)"})}
    assert ro.completions[2][1]["content"] == str(
        {"error": "note: argument x='a' does not fit its schema {'type': 'integer'}"})


def test_max_calls_bounds_the_rounds_of_tool_execution(tiny):
    """A policy that always calls again: max_calls=2 runs two rounds; the third turn's call is not run."""
    _, tok = tiny
    ro, _ = run(tiny, ["raw " + call("inc", n=1)[:-len(END)]], tools=[inc], max_calls=2, max_new_tokens=400)
    assert ro.tools.calls.tolist() == [2] and ro.tools.turns.tolist() == [3] and ro.tools.per_tool.tolist() == [[2]]
    expected = call("inc", n=1) + tool_turn("inc", "2") + call("inc", n=2) + tool_turn("inc", "3") + call("inc", n=3)
    assert row(ro, 0, ro.response_ids) == ids(tok, expected)
    assert [m["role"] for m in ro.completions[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_max_new_tokens_bounds_the_whole_completion_as_trl_does(tiny):
    """TRL's max_completion_length: results that would take the completion past the limit are dropped (the call ran
    and counts; the completion ends at the calling turn's EOS), a turn is cut at what is left, and a cut turn's
    calls do not run."""
    _, tok = tiny
    first = call("add", a=2, b=3)
    n1, n_tool = len(ids(tok, first)), len(ids(tok, tool_turn("add", "5")))
    # 1. room for the first turn but not its results: the results are dropped
    ro, _ = run(tiny, ["add 2 3"], max_new_tokens=n1 + n_tool - 1)
    assert row(ro, 0, ro.response_ids) == ids(tok, first) and ro.has_eos.tolist() == [True]
    assert ro.tools.calls.tolist() == [1] and [m["role"] for m in ro.completions[0]] == ["assistant"]
    # 2. room for the results and 3 tokens of the next turn: that turn is cut, no EOS
    ro, _ = run(tiny, ["add 2 3"], max_new_tokens=n1 + n_tool + 3)
    assert row(ro, 0, ro.response_ids) == ids(tok, first + tool_turn("add", "5") + "got")
    assert ro.has_eos.tolist() == [False] and ro.response_mask.sum().item() == n1 + n_tool + 3
    # 3. the first turn itself cut inside its call: nothing runs
    ro, _ = run(tiny, ["add 2 3"], max_new_tokens=n1 - 1)
    assert ro.tools.calls.tolist() == [0] and ro.tools.malformed.tolist() == [0] and ro.has_eos.tolist() == [False]


def test_timeouts_and_result_caps(tiny):
    import threading

    release = threading.Event()

    def slow(x: int) -> int:
        """Hang.

        Args:
            x: ignored
        """
        release.wait(10)
        return x

    def long(x: int) -> str:
        """Talk a lot.

        Args:
            x: how much
        """
        return "y" * x

    ro, _ = run(tiny, ["raw " + call("slow", x=1)[:-len(END)], "raw " + call("long", x=60)[:-len(END)]],
                tools=[slow, long], timeout_s=0.3, max_result_tokens=40)
    release.set()
    assert ro.tools.failures.tolist() == [1, 0] and ro.tools.timeouts.tolist() == [1, 0]
    assert ro.completions[0][1]["content"] == str({"error": "slow timed out after 0.3 s"})
    assert ro.completions[1][1]["content"] == "y" * 40 + " [cut: 20 more tokens]"


class Vault:
    """An environment: a secret each row sets, a tool to read it, a reward for having read it."""

    def __init__(self):
        self.secret, self.opened = None, 0

    def reset(self, **row):
        self.secret, self.opened = row["secret"], 0
        return f" [vault {row['secret']}]"

    def open_vault(self, code: int) -> str:
        """Open the vault.

        Args:
            code: the code
        """
        self.opened += 1
        return "open" if code == self.secret else "shut"

    def get_reward(self) -> float:
        return float(self.opened)


def test_environment_reset_joins_the_prompt_and_its_methods_are_tools(tiny):
    _, tok = tiny
    prompts = [([{"role": "user", "content": "raw " + call("open_vault", code=7)[:-len(END)]}], {"secret": 7}),
               ([{"role": "user", "content": "hello"}], {"secret": 3})]
    ro, examples = run(tiny, prompts, tools=[add], env=Vault)
    envs = list(ro.environments)
    assert [type(e) for e in envs] == [Vault, Vault] and envs[0] is not envs[1]
    assert [e.secret for e in envs] == [7, 3] and [e.opened for e in envs] == [1, 0]
    assert ro.completions[0][1] == {"role": "tool", "name": "open_vault", "content": "open"}
    schemas = [s.schema for s in Toolbox([add], Vault).episode_tools(envs[1], None).values()]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello [vault 3]"}], tools=schemas,
                                       tokenize=False, add_generation_prompt=True)
    assert tok.decode(ro.prompt_ids[1][ro.prompt_mask[1].bool()]) == rendered
    assert ro.tools.tool_names == ("add", "open_vault") and ro.tools.per_tool.tolist() == [[0, 1], [0, 0]]
    (reward,) = Toolbox([add], Vault).environments.reward_functions()
    assert reward(**reward_inputs(tok, ro, examples).keywords()) == [1.0, 0.0]
    # As a reward source beside a function: named after the class, weight 1, after the others.
    rewards = Rewards(RewardConfig(), tok, "cpu", given=(lambda completions, **kw: [0.5] * len(completions),),
                      given_weights=(2.0,), environment_rewards=[reward])
    scored = rewards(ro, examples)
    assert rewards.names == ["<lambda>", "Vault"] and rewards.weights.tolist() == [2.0, 1.0]
    assert scored.total.tolist() == [2.0, 1.0] and scored.per_source["Vault"].tolist() == [1.0, 0.0]


def test_an_environment_whose_call_timed_out_is_not_reused(tiny):
    """Its abandoned call may still change it: the next episode gets a new instance; an environment whose calls all
    returned is reused."""
    import threading

    release = threading.Event()

    class Stuck(Vault):
        def wait(self, x: int) -> int:
            """Hang.

            Args:
                x: x
            """
            release.wait(10)
            return x

    box = Toolbox([], Stuck)
    prompts = [("raw " + call("wait", x=1)[:-len(END)], {"secret": 1}), ("raw " + call("open_vault", code=2)[:-len(END)],
                                                                         {"secret": 2})]
    ro, _ = run(tiny, prompts, box=box, timeout_s=0.3)
    release.set()
    assert ro.tools.timeouts.tolist() == [1, 0]
    stuck, fine = ro.environments
    again = [env for _, env in box.environments.take([{}, {}])]
    assert stuck not in again and fine in again


def test_seed_per_prompt_gives_a_prompt_the_same_episodes_in_any_batch(tiny):
    """Sampled (top_k=0: the script only tilts the odds): prompts A and B together equal A alone and B alone (2
    processes ≡ 1)."""
    prompts = ["add 1 2", "add 3 4"]
    both, _ = run(tiny, prompts, num_samples=2, seed_per_prompt=True, top_k=0, step=3)
    for i, p in enumerate(prompts):
        alone, _ = run(tiny, [p], num_samples=2, seed_per_prompt=True, top_k=0, step=3)
        rows = slice(2 * i, 2 * i + 2)
        width = alone.response_ids.shape[1]
        assert torch.equal(both.response_ids[rows, :width], alone.response_ids)
        assert torch.equal(both.action_mask[rows, :width], alone.action_mask)
        torch.testing.assert_close(both.sampler_logprobs[rows, :width], alone.sampler_logprobs)


def test_tool_figures_match_trl_definitions():
    """calls_per_episode (TRL's call_frequency): calls, run or malformed, per episode; failures_per_call (TRL's
    failure_frequency): failed or malformed calls per call. Training logs both names, the same numbers."""
    counts = ToolCounts(calls=torch.tensor([2, 0, 1, 0]), failures=torch.tensor([1, 0, 0, 0]),
                        timeouts=torch.tensor([1, 0, 0, 0]), malformed=torch.tensor([0, 1, 0, 0]),
                        turns=torch.tensor([3, 2, 2, 1]), per_tool=torch.tensor([[2, 0], [0, 0], [0, 1], [0, 0]]),
                        tool_names=("add", "fail"))
    figures = ToolFigures.of(counts)
    assert figures == ToolFigures(episodes=4, turns=8, calls=4, failures=2, malformed=1, timeouts=1,
                                  per_tool=(("add", 2), ("fail", 1)))
    assert figures.metrics("tools/") == {
        "tools/calls_per_episode": 4 / 4, "tools/failures_per_call": 2 / 4, "tools/malformed_per_call": 1 / 4,
        "tools/timeouts_per_call": 1 / 4, "tools/turns_per_episode": 8 / 4, "tools/calls_per_episode/add": 2 / 4,
        "tools/calls_per_episode/fail": 1 / 4, "tools/call_frequency": 4 / 4, "tools/failure_frequency": 2 / 4}
    none = ToolCounts(*(torch.zeros(2, dtype=torch.long),) * 5, per_tool=torch.zeros(2, 1, dtype=torch.long),
                      tool_names=("add",))
    assert ToolFigures.of(none).metrics()["tools/failure_frequency"] == 0.0


def test_a_tokenizer_that_cannot_run_the_loop_is_refused_in_one_line():
    box = Toolbox([add])
    plain = build_tiny_tokenizer()  # ChatML without tools, no response template
    unparsed = build_tiny_tokenizer()
    unparsed.chat_template = templates.load("chatml_tools").chat_template  # renders tools, but nothing parses calls
    for tok, words in [(plain, "ignores `tools`"), (unparsed, "no response_template")]:
        with pytest.raises(TemplateError, match=words):
            ToolLoop(tok, GenerationConfig(), 0, box, 1, 1.0, 10)
    with pytest.raises(TemplateError, match="ignores `tools`"):  # an environment's methods are tools too
        ToolLoop(plain, GenerationConfig(), 0, Toolbox([], Vault), 1, 1.0, 10)
    # A template whose first line counts the messages renders no conversation as a prefix of a longer one.
    counting = build_tiny_tokenizer()
    counting.chat_template = "{{ messages | length }}\n" + templates.load("chatml_tools").chat_template
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        tool_suffix(counting, [{"role": "tool", "name": "add", "content": "5"}])
    tok = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tok)
    assert tok.decode(tool_suffix(tok, [{"role": "tool", "name": "add", "content": "5"}])) == tool_turn("add", "5")


# sha256 of the sampled episodes' token ids (str of the list of rows) as the tool loop drew them before the decode
# engine (its own KV-cache loop, rlhfkit 1ef2c7a), on this tiny model, with the scenario below.
BEFORE_ENGINE = {("shared", 14.0, 2): "dd46276240a002b0", ("seeded", 14.0, 3): "f9f9e31152c8478b",
                 ("shared", 10.0, 3): "e1801165ad8fb140"}


@pytest.mark.parametrize("stream, bias, k", sorted(BEFORE_ENGINE))
def test_sampled_episodes_are_the_tokens_the_loop_drew_before_the_engine(tiny, stream, bias, k):
    """Sampled (top_k=0: the script only tilts the odds), with calls, results and turns of different lengths, from
    the run's random stream or each prompt's own seed: the engine draws the tokens the tool loop's own decode loop
    drew under the same seed."""
    import hashlib

    model, tok = tiny
    params = GenerationConfig(max_new_tokens=150, num_samples=k, top_k=0, seed_per_prompt=stream == "seeded")
    loop = ToolLoop(tok, params, 0, Toolbox([add, fail]), 3, 2.0, 100)
    prompts = ["add 1 2", "hello", "add 30 4", "raw abc"]
    token_ids = [ids(tok, p) for p in prompts]
    width = max(map(len, token_ids))
    batch = PromptBatch(torch.tensor([[0] * (width - len(x)) + x for x in token_ids]),
                        torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in token_ids]))
    torch.manual_seed(5)
    ro = loop(Scripted(model, tok, script, bias), batch, [{"prompt": p, "columns": {}} for p in prompts], 1)
    assert int(ro.tools.calls.sum()) >= 2 and len(set(ro.response_mask.sum(1).tolist())) >= 3
    assert hashlib.sha256(str(ro.response_ids.tolist()).encode()).hexdigest()[:16] == BEFORE_ENGINE[(stream, bias, k)]
