"""The agent demo's task (`rlhfkit.tasks.agent`): its data and the exact-answer reward on TRL-shaped episodes, by hand
(its held-out figures are `rlhfkit.evaluation.agent`'s, tested there)."""

from rlhfkit import templates
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.tasks.agent import exact_answer, final_answer, make_splits, multiply, tool_schemas


def call(a, b):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]}


def test_final_answer_reads_the_last_number_of_a_last_turn_that_calls_nothing():
    episode = [call(347, 29), {"role": "tool", "name": "multiply", "content": "10063"},
               {"role": "assistant", "content": "347 * 29 = 10,063."}]
    assert final_answer(episode) == 10063
    assert final_answer(episode[:1]) is None  # ended on a call: no answer
    assert final_answer(episode[:2]) is None  # the tool message is not an answer: the last assistant turn calls
    assert final_answer([{"role": "assistant", "content": "no idea"}]) is None
    assert final_answer("it is 12, or 13") == 13


def test_exact_answer_rewards_the_right_final_answer_only():
    right = [call(12, 11), {"role": "tool", "name": "multiply", "content": "132"},
             {"role": "assistant", "content": "The answer is 132."}]
    copied_the_factor = [{"role": "assistant", "content": "The answer is 12."}]
    assert exact_answer([], [right, copied_the_factor, right[:1]], ["132", "132", "132"]) == [1.0, 0.0, 0.0]


def test_splits_are_disjoint_correct_and_render_with_the_tool():
    splits = make_splits(tool_traces=20, direct_traces=5, rl_prompts=30, eval_prompts=10, seed=3, guessed_traces=7)
    pairs = lambda name: {r["prompt"][-1]["content"] for r in splits[name]}  # noqa: E731
    assert len(pairs("eval")) == 10 and len(pairs("rl")) == 30 and not pairs("eval") & pairs("rl")
    traced = {r["messages"][1]["content"] for r in splits["sft"]}
    assert not traced & (pairs("eval") | pairs("rl"))
    assert sum(len(r["messages"]) == 5 for r in splits["sft"]) == 20  # tool traces: call, result, answer
    assert len(splits["sft"]) == 20 + 5 + 7
    guessed = 0
    for r in splits["sft"]:
        *_, last = r["messages"]
        if len(r["messages"]) == 5:
            args = r["messages"][2]["tool_calls"][0]["function"]["arguments"]
            assert r["messages"][3]["content"] == str(multiply(**args)) and final_answer(r["messages"][2:]) == args["a"] * args["b"]
        else:
            a, b = map(int, r["messages"][1]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
            assert final_answer([last]) == a * b
            if a >= 100:  # a large product answered directly, right (a guess the model can only imitate)
                assert 11 <= b <= 99
                guessed += 1
            else:
                assert a < 10 and b < 10
    assert guessed == 7
    for r in splits["eval"]:
        a, b = map(int, r["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 100 <= a <= 999 and 11 <= b <= 99 and r["answer"] == str(a * b)
    tok = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tok)
    text = tok.apply_chat_template(splits["sft"][0]["messages"], tools=tool_schemas(), tokenize=False)
    assert '"name": "multiply"' in text and "<tools>" in text
