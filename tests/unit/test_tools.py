"""rlhfkit.tools: schemas from signatures and docstrings (transformers' get_json_schema), what is refused at start
(one line naming the function), dispatch by exact name with arguments fitted to the schema, and what a call that
raises, hangs, returns what cannot be printed or runs long becomes (TRL's {"error": ...} text, counted); environments
(reset, their methods as tools, a dict routed by the `environment` column, get_reward as a reward source)."""

import asyncio
import threading
import time

import pytest

from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.tools import (Call, Environments, Toolbox, cap_result, describe, error_content, fit_arguments, resolve,
                           run_calls)
from tests.smoke.agent_tools import fail, recording


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def no_doc(a: int) -> int:
    return a


class Counter:
    """An environment: a count the episode's calls change, read by its reward."""

    def __init__(self):
        self.value, self.resets = 0, []

    def reset(self, **row):
        self.resets.append(row)
        self.value = row.get("start", 0)
        return f" (start at {self.value})"

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value)

    def _private(self):
        return "never a tool"


def test_schema_comes_from_the_signature_and_docstring():
    tool = describe(add)
    assert tool.name == "add"
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "required": ["a"],
        "properties": {"a": {"type": "integer", "description": "the first"},
                       "b": {"type": "integer", "description": "the second"}}}


def test_a_function_get_json_schema_cannot_describe_is_refused_in_one_line_naming_it():
    with pytest.raises(UserError) as err:
        Toolbox([add, no_doc])
    message = str(err.value)
    assert "no_doc" in message and "docstring" in message and "\n" not in message


def test_duplicate_tool_names_are_refused():
    def add(x: int) -> int:  # noqa: F811 - the point: a second tool named "add"
        """Another add.

        Args:
            x: a number
        """
        return x

    with pytest.raises(UserError, match="two tools are named 'add'"):
        Toolbox([globals()["add"], add])


def test_arguments_are_fitted_to_the_schema():
    params = describe(add).parameters
    assert fit_arguments({"a": "7", "b": 2.0}, params) == ({"a": 7, "b": 2}, None)
    for bad, why in [({"b": 1}, "missing required argument(s) a"), ({"a": 1, "c": 2}, "unknown argument(s) c"),
                     ({"a": True}, "a=True does not fit"), ({"a": 1.5}, "a=1.5 does not fit"),
                     ({"a": "seven"}, "a='seven' does not fit"), ([1], "arguments must be an object")]:
        fitted, message = fit_arguments(bad, params)
        assert fitted is None and why in message, (bad, message)
    schema = {"properties": {"k": {"type": "string", "enum": ["x", "y"]},
                             "v": {"type": "array", "items": {"type": "number"}, "nullable": True}}, "required": []}
    assert fit_arguments({"k": "x", "v": [1, "2.5"]}, schema) == ({"k": "x", "v": [1, 2.5]}, None)
    assert fit_arguments({"v": None}, schema) == ({"v": None}, None)
    assert fit_arguments({"k": "z"}, schema)[0] is None


def test_calls_resolve_by_exact_name_only():
    tools = Toolbox([add]).functions
    assert resolve("add", {"a": 1}, tools) == Call("add", {"a": 1}, tools["add"])
    for name in ("Add", "add ", "__import__", None):
        call = resolve(name, {"a": 1}, tools)
        assert call.tool is None and "unknown tool" in call.error


def test_a_raising_hanging_or_unprintable_tool_becomes_an_error_message_and_a_counted_failure():
    release = threading.Event()

    def hang(x: int) -> int:
        """Hang.

        Args:
            x: ignored
        """
        release.wait(10)
        return x

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text")

    def odd(x: int) -> int:
        """Return what cannot be printed.

        Args:
            x: ignored
        """
        return Unprintable()

    tools = Toolbox([fail, hang, odd, add]).functions
    calls = [[resolve(n, {"x": 1}, tools)] for n in ("fail", "hang", "odd")] + [[resolve("add", {"a": 2}, tools)]]
    start = time.monotonic()
    (raised,), (hung,), (unprintable,), (ok,) = run_calls(calls, timeout_s=0.5)
    release.set()
    assert time.monotonic() - start < 2.0  # the hung tool was abandoned at its deadline
    assert raised.content == str({"error": "ValueError: boom"}) and raised.failed and not raised.timed_out
    assert hung.content == str({"error": "hang timed out after 0.5 s"}) and hung.failed and hung.timed_out
    assert unprintable.content.startswith("{'error': 'odd returned a result that cannot be printed")
    assert unprintable.failed and not unprintable.timed_out
    assert (ok.content, ok.failed, ok.timed_out) == ("3", False, False)


def test_a_malformed_call_is_never_run():
    ran = []
    note = recording(ran)

    tools = Toolbox([note]).functions
    (outcome,), = run_calls([[resolve("note", {"x": "not a number"}, tools)]], timeout_s=1)
    assert ran == [] and not outcome.failed
    assert outcome.content == error_content("note: argument x='not a number' does not fit its schema {'type': 'integer'}")


def test_episodes_run_concurrently_and_an_episode_calls_in_order():
    order = []

    def nap(tag: str) -> str:
        """Sleep a little.

        Args:
            tag: a label
        """
        time.sleep(0.3)
        order.append(tag)
        return tag

    tools = Toolbox([nap]).functions
    start = time.monotonic()
    results = run_calls([[resolve("nap", {"tag": "a1"}, tools), resolve("nap", {"tag": "a2"}, tools)],
                         [resolve("nap", {"tag": "b1"}, tools), resolve("nap", {"tag": "b2"}, tools)]], timeout_s=5)
    elapsed = time.monotonic() - start
    assert [[o.content for o in r] for r in results] == [["a1", "a2"], ["b1", "b2"]]
    assert order.index("a1") < order.index("a2") and order.index("b1") < order.index("b2")
    assert elapsed < 1.0  # two episodes of 0.6 s each, side by side (one after the other: 1.2 s)


def test_an_async_tool_is_awaited():
    async def later(x: int) -> int:
        """Wait, then double.

        Args:
            x: a number
        """
        await asyncio.sleep(0.01)
        return 2 * x

    tools = Toolbox([later]).functions
    assert run_calls([[resolve("later", {"x": 4}, tools)]], timeout_s=2)[0][0].content == "8"


def test_results_past_the_cap_are_cut_and_marked():
    tok = build_tiny_tokenizer()  # one character, one token
    assert cap_result("abcdef", tok, 6) == "abcdef"
    assert cap_result("abcdefgh", tok, 5) == "abcde [cut: 3 more tokens]"


def test_environments_reset_route_and_give_their_methods_and_reward():
    class Other(Counter):
        def peek(self) -> int:
            """Read the count."""
            return self.value

    box = Toolbox([add], {"counter": Counter, "other": Other})
    assert box.names == ("add", "bump", "peek")
    envs = box.environments
    rows = [{"prompt": "p", "environment": "counter", "start": 2}, {"prompt": "q", "environment": "other"},
            {"prompt": "r", "environment": "counter"}]
    taken = envs.take(rows)
    assert [n for n, _ in taken] == ["counter", "other", "counter"]
    assert [type(e) for _, e in taken] == [Counter, Other, Counter] and taken[0][1] is not taken[2][1]
    assert envs.take(rows[:1])[0][1] is taken[0][1]  # pooled: made once, reset before each episode
    env = taken[0][1]
    assert env.reset(**envs.reset_arguments(rows[0])) == " (start at 2)"
    assert env.resets == [{"prompt": "p", "start": 2}]  # the routing column is not passed
    tools = box.episode_tools(env, "counter")
    assert sorted(tools) == ["add", "bump"] and tools["bump"].fn.__self__ is env
    counter_reward, other_reward = envs.reward_functions()  # one per class with a get_reward, named after it
    assert (counter_reward.__name__, other_reward.__name__) == ("Counter", "Other")
    env.bump(3)
    other = taken[1][1]
    other.reset(prompt="q")
    assert counter_reward(environments=[env, other]) == [5.0, None]  # a row of exactly its class, else None
    assert other_reward(environments=[env, other]) == [None, 0.0]


def test_environment_mistakes_are_refused_in_one_line():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: a number
            """
            return x

    class Clash(Counter):
        def add(self, a: int) -> int:
            """Shadow the standalone tool.

            Args:
                a: a number
            """
            return a

    class Undocumented(Counter):
        def act(self, x):
            return x

    for factory, words in [(NoReset, "has no callable reset()"), (Clash, "two tools are named 'add'"),
                           (Undocumented, "Undocumented.act"), ({}, "empty dict")]:
        with pytest.raises(UserError) as err:
            Toolbox([add], factory)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(UserError, match="environment='nope' names none of"):
        Environments({"counter": Counter}, {}).take([{"environment": "nope"}])


class AsyncCounter(Counter):
    """An environment whose reward is a coroutine (TRL allows `async def get_reward`)."""

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.value) + 0.5


def test_an_async_get_reward_works_inside_a_running_event_loop():
    """A notebook runs an event loop in its main thread, where `asyncio.run` is refused: the environment's reward is
    awaited all the same, as an async reward function's is, outside a loop and inside one."""
    envs = Toolbox([], AsyncCounter).environments
    (_, env), = envs.take([{"prompt": "p", "start": 3}])
    env.reset(start=3)
    reward, = envs.reward_functions()
    assert reward(environments=[env]) == [3.5]

    async def in_a_loop():
        return reward(environments=[env])

    assert asyncio.run(in_a_loop()) == [3.5]
