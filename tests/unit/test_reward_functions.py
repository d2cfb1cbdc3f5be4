"""Python reward functions (`reward.function`, `reward.gold_function`, eval judges) under TRL's contract: keywords
(prompts=, completions=, completion_ids=, every data column, trainer_state=), conversational completions as message
lists, None for a row a function does not apply to, async functions, several sources weighted, reward models with a
tokenizer of their own; what a bad return value or a raising function becomes (a one-line UserError naming the
function), and importing without touching sys.path.

Rollouts are built by hand on the char-level tiny tokenizer (one character = one token, pad == eos)."""

import math
import sys
import uuid
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.config import DataConfig
from rlhfkit.data import build_datasets
from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.reward_functions import RewardInputs, load_reward_function
from rlhfkit.rewards import RewardModelSource, Rewards, reward_inputs
from rlhfkit.types import Rollout


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def rollout(tok, prompts: list[str], responses: list[str], k: int = 1) -> Rollout:
    """Rendered prompts (left-padded) and responses (each + EOS, right-padded); k adjacent samples per prompt."""
    def render(p):
        return tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)

    p_ids = [tok(render(p), add_special_tokens=False)["input_ids"] for p in prompts for _ in range(k)]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    P, R, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    return Rollout(
        prompt_ids=torch.tensor([[pad] * (P - len(x)) + x for x in p_ids]),
        prompt_mask=torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in p_ids]),
        response_ids=torch.tensor([x + [pad] * (R - len(x)) for x in r_ids]),
        response_mask=torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in r_ids]),
        group_ids=torch.arange(len(prompts)).repeat_interleave(k),
        has_eos=torch.ones(len(r_ids), dtype=torch.bool),
        sampler_logprobs=torch.zeros(len(r_ids), R),
        action_mask=torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in r_ids]),
    )


@pytest.fixture
def module(tmp_path, monkeypatch):
    """Writes Python source as a fresh module in the working directory (as a user's reward file); returns its name."""
    monkeypatch.chdir(tmp_path)
    names = []

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


def rewards(function=None, gold_function=None, model=(), weights=None, ensemble="mean", batch_size=None):
    cfg = SimpleNamespace(function=function, gold_function=gold_function, model=list(model), ensemble=ensemble,
                          weights=weights, quantization=None)
    return Rewards(cfg, build_tiny_tokenizer(), "cpu", batch_size=batch_size, policy_name="tiny")


def source(function=None, gold_function=None):
    """One reward function: called on a rollout, its (B,) scores."""
    r = rewards(function, gold_function)

    class Total:
        gold = r.gold

        def __call__(self, *args, **kwargs):
            return r(*args, **kwargs).total

    return Total()


RECORDER = """
CALLS = []
def reward(prompts, completions, answer, completion_ids, **kwargs):
    hooks = sorted(k for k in ("log_metric", "log_extra") if callable(kwargs.pop(k, None)))  # TRL 1.16's logging hooks
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, "completion_ids": completion_ids,
                  "kwargs": kwargs, "hooks": hooks})
    return [float(len(c)) for c in completions]
"""


# 1. The contract ----------------------------------------------------------------------------------------------


def test_one_call_with_original_prompts_completions_and_every_column(tok, module):
    name = module(RECORDER)
    examples = [{"prompt_ids": [], "prompt": "3+4=", "columns": {"answer": "7", "level": 1}},
                {"prompt_ids": [], "prompt": [{"role": "user", "content": "5+5="}], "columns": {"answer": "10"}}]
    ro = rollout(tok, ["3+4=", "5+5="], ["7", "x", "10", "ten"], k=2)
    rows = [examples[g] for g in ro.group_ids.tolist()]
    scores = source(f"{name}:reward")(ro, rows)
    (call,) = sys.modules[name].CALLS
    assert call["prompts"] == ["3+4=", "3+4=", [{"role": "user", "content": "5+5="}]] + [[{"role": "user", "content": "5+5="}]]
    # Special tokens (EOS, padding) stripped; a row with a conversational prompt gets the assistant's message.
    assert call["completions"] == ["7", "x", [{"role": "assistant", "content": "10"}], [{"role": "assistant", "content": "ten"}]]
    assert call["answer"] == ["7", "7", "10", "10"]
    assert call["kwargs"] == {"level": [1, 1, None, None], "trainer_state": None}  # a column some records lack: None
    assert call["hooks"] == ["log_extra", "log_metric"]
    assert call["completion_ids"] == [tok("7")["input_ids"] + [tok.eos_token_id], tok("x")["input_ids"] + [tok.eos_token_id],
                                      tok("10")["input_ids"] + [tok.eos_token_id], tok("ten")["input_ids"] + [tok.eos_token_id]]
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 1.0, 1.0, 1.0]  # len() of a one-message list is 1


def test_two_argument_functions_get_no_keywords(tok):
    ro = rollout(tok, ["p"], ["aab", "zzzz"], k=2)
    rows = [{"prompt_ids": [], "prompt": "p", "columns": {"answer": "7"}}] * 2
    scores = source("rlhfkit.tasks.toy:vowel_reward")(ro, rows)
    torch.testing.assert_close(scores, torch.tensor([2 / 3, 0.0]))


def test_without_examples_prompts_are_the_decoded_prompt_text(tok, module):
    name = module(RECORDER.replace("completions, answer, completion_ids", "completions, completion_ids").replace('"answer": answer, ', ""))
    source(f"{name}:reward")(rollout(tok, ["3+4="], ["7"]))
    (call,) = sys.modules[name].CALLS
    assert call["prompts"] == ["user\n3+4=\nassistant\n"] and call["kwargs"] == {"trainer_state": None}


def test_gold_function_follows_the_same_contract(tok, module):
    name = module(RECORDER)
    rows = [{"prompt_ids": [], "prompt": "q", "columns": {"answer": "a"}}] * 2
    gold = source("rlhfkit.tasks.toy:vowel_reward", gold_function=f"{name}:reward").gold(rollout(tok, ["q"], ["ab", "c"], k=2), rows)
    assert gold.tolist() == [2.0, 1.0] and sys.modules[name].CALLS[0]["answer"] == ["a", "a"]


def test_a_required_argument_without_a_column_is_named(tok, module):
    name = module(RECORDER)
    rows = [{"prompt_ids": [], "prompt": "q", "columns": {"solution": "a"}}]
    with pytest.raises(UserError) as err:
        source(f"{name}:reward")(rollout(tok, ["q"], ["a"]), rows)
    assert str(err.value) == (f"reward.function '{name}:reward' takes an argument 'answer', but the prompt records have no "
                              "field 'answer' (fields: solution)")


def test_every_task_function_works_on_original_prompts(tok):
    """The built-in reward functions, given the dataset's own prompts and the real contract."""
    ro = rollout(tok, ["Review the lamp Sado."], ["It was great.", "It was dull and bad."], k=2)
    rows = [{"prompt_ids": [], "prompt": "Review the lamp Sado.", "columns": {}}] * 2
    torch.testing.assert_close(source("rlhfkit.tasks.toy:vowel_reward")(ro, rows), torch.tensor([3 / 13, 4 / 20]))
    pytest.importorskip("vaderSentiment")
    reviews = source("rlhfkit.tasks.reviews:gold_judge")(ro, rows)
    assert reviews[0] > 0.5 and reviews[1] < -0.5


# 2. Bad functions: one line naming the function and what it returned -------------------------------------------

BAD = {
    "none": ("return None", "returned None, expected a list of 2 numbers (one per completion)"),
    "string": ("return '1.0'", "returned a str ('1.0'), expected a list of 2 numbers (one per completion)"),
    "scalar": ("return 0.5", "returned a float (0.5), expected a list of 2 numbers (one per completion)"),
    "short": ("return [1.0]", "returned a list of 1 values, expected 2 (one per completion)"),
    "strings": ("return ['1', '0']", "returned a non-number at row 0: '1' (str)"),
    "nan string": ("return [1.0, 'nan']", "returned a non-number at row 1: 'nan' (str)"),
    "nested": ("return [[1.0], [0.0]]", "returned a non-number at row 0: [1.0] (list)"),
    "tensor shape": ("import torch; return torch.zeros(2, 1)", "returned a Tensor of shape (2, 1), expected shape (2,)"),
    "0-d tensor": ("import torch; return torch.tensor(1.0)", "returned a Tensor of shape (), expected shape (2,)"),
    "raises": ("raise KeyError('answer')", "raised KeyError: 'answer'"),
    "raises multi-line": ("raise ValueError('bad parse\\nsecond line')", "raised ValueError: bad parse"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("gold", [False, True])
def test_bad_function_is_one_line_naming_it(case, gold, tok, module):
    body, expected = BAD[case]
    name = module(f"def fn(prompts, completions):\n    {body}\n")
    ref = f"{name}:fn"
    src = source("rlhfkit.tasks.toy:vowel_reward", ref) if gold else source(ref)
    with pytest.raises(UserError) as err:
        (src.gold if gold else src)(rollout(tok, ["q"], ["a", "b"], k=2))
    key = "reward.gold_function" if gold else "reward.function"
    message = str(err.value)
    assert message.startswith(f"{key} '{ref}' {expected}"), message
    assert "\n" not in message
    if case.startswith("raises"):
        assert message.endswith(f"({name}.py:2)")  # where in the user's file


def test_accepted_return_types_and_non_finite_values(tok, module):
    name = module(
        "import math, numpy, torch\n"
        "def tensor(prompts, completions): return torch.tensor([1.0, float('nan')], dtype=torch.float64)\n"
        "def array(prompts, completions): return numpy.array([2, 3])\n"
        "def tuple_(prompts, completions): return (True, -math.inf)\n"
        "def tensors(prompts, completions): return [torch.tensor(0.5), numpy.float32(1.5)]\n"
    )
    ro = rollout(tok, ["q"], ["a", "b"], k=2)
    out = {fn: source(f"{name}:{fn}")(ro).tolist() for fn in ("tensor", "array", "tuple_", "tensors")}
    assert math.isnan(out["tensor"][1]) and out["tensor"][0] == 1.0
    assert out["array"] == [2.0, 3.0] and out["tuple_"] == [1.0, -math.inf] and out["tensors"] == [0.5, 1.5]


# 3. Importing -------------------------------------------------------------------------------------------------


def test_loading_leaves_sys_path_unchanged(module, tmp_path):
    name = module("def fn(prompts, completions):\n    return [0.0] * len(completions)\n")
    before = list(sys.path)
    assert load_reward_function(f"{name}:fn")(RewardInputs(["p"], ["c"], [[]])) == [0.0]  # the working directory is importable ...
    assert sys.path == before  # ... only while importing
    assert str(tmp_path) not in sys.path


@pytest.mark.parametrize("ref,message", [
    ("no_such_module_xyz:f", "reward.function 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz' (No module named 'no_such_module_xyz')"),
    ("rlhfkit.tasks.toy:nope", "reward.function 'rlhfkit.tasks.toy:nope': module 'rlhfkit.tasks.toy' has no function 'nope'"),
])
def test_load_errors(ref, message):
    with pytest.raises(UserError) as err:
        load_reward_function(ref)
    assert str(err.value) == message


def test_a_module_that_fails_to_import_is_one_line(module):
    name = module("x = 1 / 0\n")
    with pytest.raises(UserError) as err:
        load_reward_function(f"{name}:fn", "reward.gold_function")
    assert str(err.value) == f"reward.gold_function '{name}:fn': cannot import module '{name}' (ZeroDivisionError: division by zero)"


# 4. Through the data pipeline: the prompt examples' own fields reach the function --------------------------------


def test_dataset_columns_reach_the_function(tok, module, tmp_path):
    name = module(RECORDER)
    (tmp_path / "p.jsonl").write_text('{"prompt": "3+4=", "answer": "7"}\n{"prompt": "2+2=", "answer": "4", "hint": "even"}\n')
    examples, _ = build_datasets("prompt", DataConfig(train=str(tmp_path / "p.jsonl"), max_length=64), tok, seed=0)
    ro = rollout(tok, ["3+4=", "2+2="], ["7", "5"])
    source(f"{name}:reward")(ro, [examples[g] for g in ro.group_ids.tolist()])
    (call,) = sys.modules[name].CALLS
    assert call["prompts"] == ["3+4=", "2+2="] and call["answer"] == ["7", "4"]
    assert call["kwargs"] == {"hint": [None, "even"], "trainer_state": None}


def test_a_completion_column_is_not_passed_as_trl_leaves_it_out(tok, module, tmp_path):
    """TRL passes every column but prompt, completion and completion_ids: a record's reference completion does not
    reach the function as `completion=`, and `completion_ids` are always the sampled ids."""
    name = module(RECORDER)
    (tmp_path / "p.jsonl").write_text('{"prompt": "3+4=", "answer": "7", "completion": "7", "completion_ids": [1]}\n')
    examples, _ = build_datasets("prompt", DataConfig(train=str(tmp_path / "p.jsonl"), max_length=64), tok, seed=0)
    ro = rollout(tok, ["3+4="], ["8"])
    source(f"{name}:reward")(ro, examples)
    (call,) = sys.modules[name].CALLS
    assert call["kwargs"] == {"trainer_state": None} and call["answer"] == ["7"]
    assert call["completion_ids"] == [tok("8")["input_ids"] + [tok.eos_token_id]]


class LengthScorer:
    """A stub reward model on the policy's tokens: each row's response length; records its batch sizes."""

    tokenizer = None

    def __init__(self):
        self.sizes = []

    def __call__(self, ids, mask, response_mask):
        self.sizes.append(ids.shape[0])
        return response_mask.sum(-1).float()


def test_reward_models_score_in_chunks_of_batch_size(tok):
    scorer = LengthScorer()
    rm = RewardModelSource(scorer, "rm", tok, batch_size=2)
    ro = rollout(tok, ["q", "r"], ["a", "bb", "ccc", "dddd"], k=2)
    values, applies = rm.score(ro, reward_inputs(tok, ro))
    assert values.tolist() == [2.0, 3.0, 4.0, 5.0] and applies.all()  # responses + EOS
    assert scorer.sizes == [2, 2]


# 5. TRL's contract: keywords, conversational data, None, async, several sources, trainer_state -------------------

SHAPES = """
import asyncio

def completions_only(completions, **kwargs):
    return [float(len(c)) for c in completions]

def with_solution(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]

def keyword_only(*, prompts, completions):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

def some_none(completions, **kwargs):
    return [None if c.startswith("x") else 2.0 for c in completions]

async def awaited(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(c.count("b")) for c in completions]

def by_step(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)

CALLS = []
def everything(**kwargs):
    CALLS.append(kwargs)
    return [0.0] * len(kwargs["completions"])
"""


@pytest.fixture
def shapes(module):
    return module(SHAPES)


def rows_of(ro, examples):
    return [examples[g] for g in ro.group_ids.tolist()]


@pytest.mark.parametrize("fn,expected", [
    ("completions_only", [1.0, 2.0, 2.0, 1.0]),
    ("with_solution", [1.0, 0.0, 0.0, 0.0]),
    ("keyword_only", [5.0, 6.0, 4.0, 3.0]),
    ("awaited", [0.0, 2.0, 0.0, 0.0]),
])
def test_trl_shaped_functions_are_called_with_keywords(fn, expected, tok, shapes):
    ro = rollout(tok, ["3+4=", "q1"], ["7", "bb", "10", "x"], k=2)
    examples = [{"prompt": "3+4=", "columns": {"solution": "7"}}, {"prompt": "q1", "columns": {"solution": "2"}}]
    assert rewards(f"{shapes}:{fn}")(ro, rows_of(ro, examples)).total.tolist() == expected


def test_an_async_function_is_awaited_inside_a_running_event_loop(tok, shapes):
    """As in a notebook, whose main thread runs an event loop: the same one runner as tools and environments."""
    import asyncio

    ro = rollout(tok, ["3+4=", "q1"], ["7", "bb", "10", "x"], k=2)
    examples = [{"prompt": "3+4=", "columns": {"solution": "7"}}, {"prompt": "q1", "columns": {"solution": "2"}}]

    async def in_a_loop():
        return rewards(f"{shapes}:awaited")(ro, rows_of(ro, examples)).total.tolist()

    assert asyncio.run(in_a_loop()) == [0.0, 2.0, 0.0, 0.0]


def test_everything_a_kwargs_function_receives(tok, shapes):
    from transformers import TrainerState

    ro = rollout(tok, ["q"], ["ab", "c"], k=2)
    state = TrainerState(global_step=3, max_steps=10)
    rewards(f"{shapes}:everything")(ro, rows_of(ro, [{"prompt": "q", "columns": {"solution": "a", "id": 7}}]), state)
    (call,) = sys.modules[shapes].CALLS
    assert set(call) == {"prompts", "completions", "completion_ids", "trainer_state", "solution", "id", "log_metric",
                         "log_extra"}
    assert call["prompts"] == ["q", "q"] and call["completions"] == ["ab", "c"] and call["solution"] == ["a", "a"]
    assert call["id"] == [7, 7] and call["trainer_state"] is state
    assert call["completion_ids"] == [tok("ab")["input_ids"] + [tok.eos_token_id], tok("c")["input_ids"] + [tok.eos_token_id]]


def test_trainer_state_reaches_the_function(tok, shapes):
    from rlhfkit.reward_functions import trainer_state

    ro = rollout(tok, ["q"], ["a"])
    assert rewards(f"{shapes}:by_step")(ro, None, trainer_state(5, 20)).total.tolist() == [5.0]


def test_conversational_prompts_and_completions_are_message_lists(tok, module):
    name = module(RECORDER.replace("completions, answer, completion_ids", "completions, completion_ids")
                  .replace('"answer": answer, ', "").replace("len(c)", "len(c[0]['content'])"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ro = rollout(tok, ["Hi"], ["yo", "hey"], k=2)
    scores = rewards(f"{name}:reward")(ro, rows_of(ro, [{"prompt": messages, "columns": {}}])).total
    (call,) = sys.modules[name].CALLS
    assert call["prompts"] == [messages, messages]
    assert call["completions"] == [[{"role": "assistant", "content": "yo"}], [{"role": "assistant", "content": "hey"}]]
    assert scores.tolist() == [2.0, 3.0]


def test_trl_think_format_reward_on_conversational_data(tok):
    ro = rollout(tok, ["q"], ["<think>\nhmm\n</think>\n42", "42"], k=2)
    rows = rows_of(ro, [{"prompt": [{"role": "user", "content": "q"}], "columns": {}}])
    assert rewards("trl.rewards:think_format_reward")(ro, rows).total.tolist() == [1.0, 0.0]


def test_trl_accuracy_reward_returns_none_for_an_unparseable_solution(tok):
    ro = rollout(tok, ["q", "r"], ["\\boxed{2}", "\\boxed{3}", "\\boxed{2}", "\\boxed{3}"], k=2)
    rows = rows_of(ro, [{"prompt": [{"role": "user", "content": "q"}], "columns": {"solution": "$2$"}},
                        {"prompt": [{"role": "user", "content": "r"}], "columns": {"solution": "hello"}}])
    scores = rewards("trl.rewards:accuracy_reward")(ro, rows)
    assert scores.total.tolist() == [1.0, 0.0, 0.0, 0.0]  # rows 2-3: no source applies, scored 0
    assert scores.unscored.tolist() == [False, False, True, True]
    assert scores.per_source["accuracy_reward"][:2].tolist() == [1.0, 0.0]
    assert scores.per_source["accuracy_reward"][2:].isnan().all()


def test_none_is_dropped_from_the_weighted_sum_and_an_unscored_row_scores_zero_with_one_warning(tok, shapes, caplog):
    """Two functions, weights 0.5 and 2: completions "7", "xy", "bb", "x" (rows 1 and 3 start with x)."""
    ro = rollout(tok, ["q"], ["7", "xy", "bb", "x"], k=4)
    r = rewards([f"{shapes}:some_none", f"{shapes}:awaited"], weights=[0.5, 2.0])
    both = rewards([f"{shapes}:some_none", f"{shapes}:some_none"], weights=[1.0, 1.0])
    caplog.set_level("WARNING", logger="rlhfkit")
    scores = r(ro)
    # some_none: 2, None, 2, None; awaited (count of "b"): 0, 0, 2, 0.
    assert scores.total.tolist() == [0.5 * 2, 2.0 * 0, 0.5 * 2 + 2.0 * 2, 2.0 * 0]
    assert scores.unscored.tolist() == [False, False, False, False]
    torch.testing.assert_close(scores.per_source["some_none"], torch.tensor([2.0, math.nan, 2.0, math.nan]), equal_nan=True)
    assert not caplog.records
    first = both(ro)
    assert first.total.tolist() == [4.0, 0.0, 4.0, 0.0] and first.unscored.tolist() == [False, True, False, True]
    assert list(first.per_source) == ["some_none", "some_none_1"]  # a repeated name gets its position
    both(ro)
    warnings = [rec for rec in caplog.records if "returned None" in rec.getMessage()]
    assert len(warnings) == 1 and "2 row(s)" in warnings[0].getMessage()


def test_a_nan_the_function_returns_itself_is_not_dropped(tok, module):
    name = module("def fn(completions, **kw):\n    return [float('nan'), 1.0]\n")
    total = rewards([f"{name}:fn", "rlhfkit.tasks.toy:vowel_reward"])(rollout(tok, ["q"], ["a", "b"], k=2)).total
    assert math.isnan(total[0]) and total[1] == 1.0


def test_source_stats_are_trls_nanmean_and_bessel_nanstd():
    from rlhfkit.reward_functions import source_stats

    stats = source_stats({"fmt": torch.tensor([1.0, 3.0, math.nan]), "one": torch.tensor([math.nan, 4.0, math.nan])})
    assert stats["rewards/fmt/mean"] == 2.0 and stats["rewards/fmt/std"] == pytest.approx(math.sqrt(2.0))
    assert stats["rewards/one/mean"] == 4.0 and math.isnan(stats["rewards/one/std"])  # TRL: NaN for one value


def test_weights_must_match_the_sources(tok):
    with pytest.raises(UserError) as err:
        rewards(["rlhfkit.tasks.toy:vowel_reward"], weights=[1.0, 2.0])
    assert str(err.value) == ("config key 'reward.weights': 2 weights for 1 reward sources (vowel_reward): give one per source")


# 6. Reward models next to functions, and reward models with a tokenizer of their own -----------------------------

OTHER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")


def other_tokenizer():
    """A character-level tokenizer whose ids differ from the tiny one's (reversed order, other specials)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>"] + list(reversed(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    out.chat_template = OTHER_TEMPLATE
    return out


def save_rm(path, tokenizer, vocab_size=None, seed=0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def own_scores(path, texts):
    """The reward model at `path` on `texts` in its own tokens, one text at a time (no padding): its last token."""
    from rlhfkit.models import load_reward_model
    from rlhfkit.config import ModelConfig

    tokenizer = other_tokenizer()
    model = load_reward_model(ModelConfig(name_or_path=path), tokenizer, trainable=False)
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])
            out.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def test_a_reward_model_with_its_own_tokenizer_scores_the_retokenised_text(tok, tmp_path):
    path = save_rm(tmp_path / "rm_other", other_tokenizer())
    ro = rollout(tok, ["Say hi.", "Go"], ["hi!", "hello there", "no", "ok"], k=2)
    standard = [{"prompt": "Say hi.", "columns": {}}, {"prompt": "Go", "columns": {}}]
    r = rewards(model=[path], batch_size=3)
    assert r.sources[0].retokenize and r.names == ["rm_other"]
    expected = own_scores(path, ["Say hi.hi!", "Say hi.hello there", "Gono", "Gook"])  # TRL: prompt + completion
    torch.testing.assert_close(r(ro, rows_of(ro, standard)).total, expected, atol=1e-5, rtol=0)
    chat = [{"prompt": [{"role": "user", "content": "Say hi."}], "columns": {}},
            {"prompt": [{"role": "user", "content": "Go"}], "columns": {}}]
    expected = own_scores(path, [f"[user] {p}\n[assistant] {c}\n" for p, c in
                                 [("Say hi.", "hi!"), ("Say hi.", "hello there"), ("Go", "no"), ("Go", "ok")]])
    torch.testing.assert_close(r(ro, rows_of(ro, chat)).total, expected, atol=1e-5, rtol=0)


def test_reward_models_and_functions_mixed_with_weights(tok, tmp_path):
    path = save_rm(tmp_path / "judge", other_tokenizer())
    ro = rollout(tok, ["Go"], ["aa", "bcd"], k=2)
    rows = rows_of(ro, [{"prompt": "Go", "columns": {}}])
    scores = rewards("rlhfkit.tasks.toy:vowel_reward", model=[path], weights=[2.0, 0.5])(ro, rows)
    rm = own_scores(path, ["Goaa", "Gobcd"])
    assert list(scores.per_source) == ["judge", "vowel_reward"]  # reward models first, then functions
    torch.testing.assert_close(scores.per_source["judge"], rm, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.total, 2.0 * rm + 0.5 * torch.tensor([1.0, 0.0]), atol=1e-5, rtol=0)


def test_an_ensemble_is_one_source_and_none_keeps_each_model(tok, tmp_path):
    a, b = save_rm(tmp_path / "a", other_tokenizer(), seed=1), save_rm(tmp_path / "b", other_tokenizer(), seed=2)
    ro = rollout(tok, ["Go"], ["aa", "bcd"], k=2)
    rows = rows_of(ro, [{"prompt": "Go", "columns": {}}])
    sa, sb = own_scores(a, ["Goaa", "Gobcd"]), own_scores(b, ["Goaa", "Gobcd"])
    low = rewards(model=[a, b], ensemble="min")(ro, rows)
    assert list(low.per_source) == ["ensemble_min"]
    torch.testing.assert_close(low.total, torch.minimum(sa, sb), atol=1e-5, rtol=0)
    each = rewards(model=[a, b], ensemble="none", weights=[1.0, -1.0])(ro, rows)
    assert list(each.per_source) == ["a", "b"]
    torch.testing.assert_close(each.total, sa - sb, atol=1e-5, rtol=0)


def test_a_reward_model_without_a_tokenizer_and_another_vocabulary_is_refused(tmp_path):
    path = save_rm(tmp_path / "bare", None, vocab_size=50)
    with pytest.raises(UserError) as err:
        rewards(model=[path])
    assert str(err.value) == (f"reward model '{path}' has no tokenizer of its own and its vocabulary (50 tokens) is not the "
                              f"policy tokenizer's ('tiny', {len(build_tiny_tokenizer())} tokens): it cannot score the "
                              "policy's tokens; save the reward model with its tokenizer")


def test_a_reward_model_on_the_policys_tokens_reads_the_rollout_ids(tok, tmp_path):
    path = save_rm(tmp_path / "same", None, vocab_size=len(tok))  # no tokenizer, the policy's vocabulary
    r = rewards(model=[path])
    assert not r.sources[0].retokenize
    ro = rollout(tok, ["Go"], ["aa"])
    expected = own_scores_ids(path, ro)
    torch.testing.assert_close(r(ro).total, expected, atol=1e-5, rtol=0)


def own_scores_ids(path, ro):
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_reward_model

    model = load_reward_model(ModelConfig(name_or_path=path), build_tiny_tokenizer(), trainable=False)
    ids = ro.input_ids[ro.attention_mask.bool()].unsqueeze(0)  # one row: its real tokens, ending with EOS
    with torch.no_grad():  # the head at the last token (transformers' own pooling skips an EOS that is also pad)
        return model.score(model.model(input_ids=ids).last_hidden_state)[:, -1, 0]


# 7. Reward-model objects given from Python (`reward_funcs`), and tokenizers that differ only in their template ---


def given_rewards(*given, weights=None):
    cfg = SimpleNamespace(function=None, gold_function=None, model=[], ensemble="mean", weights=None, quantization=None)
    return Rewards(cfg, build_tiny_tokenizer(), "cpu", policy_name="tiny", given=list(given), given_weights=weights)


def rm_object(vocab_size, seed=0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


def test_a_reward_model_object_built_in_memory_is_named_by_its_position(tok):
    """An object with no directory behind it (name_or_path "") is `reward_model_<i>`, not '.'."""
    r = given_rewards("rlhfkit.tasks.toy:vowel_reward", rm_object(len(tok)))
    assert r.names == ["vowel_reward", "reward_model_1"]


@pytest.mark.parametrize("size", [len(build_tiny_tokenizer()) - 3, len(build_tiny_tokenizer()) + 97])
def test_a_reward_model_object_of_another_vocabulary_without_its_tokenizer_is_refused(size):
    """Bigger as much as smaller: only the policy's size, or its size padded to a multiple of 64, reads its ids."""
    with pytest.raises(UserError) as err:
        given_rewards(rm_object(size))
    assert str(err.value) == (f"reward_funcs[0]: a reward model whose vocabulary ({size} tokens) is not the policy "
                              f"tokenizer's ('tiny', {len(build_tiny_tokenizer())} tokens): pass it with its own "
                              "tokenizer, as a (model, tokenizer) pair")


def test_a_reward_model_object_with_a_padded_vocabulary_reads_the_policys_ids(tok):
    assert not given_rewards(rm_object(128)).sources[0].retokenize  # 103 tokens padded to 128 = 2 x 64


def test_the_same_vocabulary_under_another_chat_template_is_retokenised(tok, tmp_path):
    """TRL renders the conversation with the reward model's own chat template: same ids but another template must
    not score the policy's rendering."""
    own = build_tiny_tokenizer()
    own.chat_template = OTHER_TEMPLATE
    path = save_rm(tmp_path / "rm_template", own)
    r = rewards(model=[path])
    assert r.sources[0].retokenize
    ro = rollout(tok, ["Go"], ["no", "ok"], k=2)
    chat = [{"prompt": [{"role": "user", "content": "Go"}], "columns": {}}]
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_reward_model

    model = load_reward_model(ModelConfig(name_or_path=path), own, trainable=False)
    expected = []
    with torch.no_grad():
        for c in ["no", "ok"]:
            ids = torch.tensor([own(f"[user] Go\n[assistant] {c}\n", add_special_tokens=False)["input_ids"]])
            expected.append(model(input_ids=ids).logits[0, 0])
    torch.testing.assert_close(r(ro, rows_of(ro, chat)).total, torch.stack(expected), atol=1e-5, rtol=0)


def test_reward_models_load_with_the_runs_attention_implementation(tmp_path):
    """model.attn_implementation applies to the run's reward models too, not only to the policy."""
    path = save_rm(tmp_path / "rm", other_tokenizer())
    cfg = SimpleNamespace(function=None, gold_function=None, model=[path], ensemble="mean", weights=None, quantization=None)
    r = Rewards(cfg, build_tiny_tokenizer(), "cpu", policy_name="tiny", attn_implementation="eager")
    assert r.sources[0].scorer.model.config._attn_implementation == "eager"
