"""Python reward functions (`reward.function`, `reward.gold_function`, eval judges): the calling contract (original
prompts, completions, every data column as a keyword argument, one call per rollout), what a bad return value or a
raising function becomes (a one-line UserError naming the function), and importing without touching sys.path.

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
from rlhfkit.rewards import RewardSource, load_reward_function
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


def source(function=None, gold_function=None):
    cfg = SimpleNamespace(function=function, gold_function=gold_function, model=[], ensemble="mean")
    return RewardSource(cfg, build_tiny_tokenizer(), "cpu")


RECORDER = """
CALLS = []
def reward(prompts, completions, answer, completion_ids, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, "completion_ids": completion_ids,
                  "kwargs": kwargs})
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
    assert call["completions"] == ["7", "x", "10", "ten"]  # special tokens (EOS, padding) stripped
    assert call["answer"] == ["7", "7", "10", "10"]
    assert call["kwargs"] == {"level": [1, 1, None, None]}  # a column some records lack: None for those rows
    assert call["completion_ids"] == [tok("7")["input_ids"] + [tok.eos_token_id], tok("x")["input_ids"] + [tok.eos_token_id],
                                      tok("10")["input_ids"] + [tok.eos_token_id], tok("ten")["input_ids"] + [tok.eos_token_id]]
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 1.0, 2.0, 3.0]


def test_two_argument_functions_get_no_keywords(tok):
    ro = rollout(tok, ["p"], ["aab", "zzzz"], k=2)
    rows = [{"prompt_ids": [], "prompt": "p", "columns": {"answer": "7"}}] * 2
    scores = source("rlhfkit.tasks.toy:vowel_reward")(ro, rows)
    torch.testing.assert_close(scores, torch.tensor([2 / 3, 0.0]))


def test_without_examples_prompts_are_the_decoded_prompt_text(tok, module):
    name = module(RECORDER.replace("completions, answer, completion_ids", "completions, completion_ids").replace('"answer": answer, ', ""))
    source(f"{name}:reward")(rollout(tok, ["3+4="], ["7"]))
    (call,) = sys.modules[name].CALLS
    assert call["prompts"] == ["user\n3+4=\nassistant\n"] and call["kwargs"] == {}


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
    "none inside": ("return [1.0, None]", "returned a non-number at row 1: None (NoneType)"),
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
    assert load_reward_function(f"{name}:fn")(["p"], ["c"]) == [0.0]  # the working directory is importable ...
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
    assert call["prompts"] == ["3+4=", "2+2="] and call["answer"] == ["7", "4"] and call["kwargs"] == {"hint": [None, "even"]}


def test_reward_models_score_in_chunks_of_batch_size(tok):
    sizes = []

    def scorer(ids, mask, response_mask):
        sizes.append(ids.shape[0])
        return response_mask.sum(-1).float()  # each row's response length

    src = source("rlhfkit.tasks.toy:vowel_reward")
    src.scorer, src.batch_size = scorer, 2
    assert src(rollout(tok, ["q", "r"], ["a", "bb", "ccc", "dddd"], k=2)).tolist() == [2.0, 3.0, 4.0, 5.0]
    assert sizes == [2, 2]
