"""The multi-turn rollout with tools: episodes in which the policy calls the run's tools (`rlhfkit.tools`) and reads
their results, under TRL 1.16's contract (`GRPOTrainer(tools=..., environment_factory=...)`).

One step's episodes are batched in one session of rlhfkit's decode engine (`generation.Session`). Each turn, every
live episode samples an assistant turn; each finished turn is parsed by transformers' response parsing (the tokenizer's
`response_template`, arguments cast to the tools' schemas); the calls run (`tools.run_calls`: episodes concurrently);
their results and the next assistant header are appended as the chat template renders them (`tool_suffix`), and only
the episodes that called a tool go on; with `generation.max_batch_rows`, waiting prompts' episodes join the session
between rounds as ended episodes leave room (continuous refill). The session keeps the KV cache across turns: a turn
feeds only the tokens appended since the last (the tool results and the header), never the conversation again, and
the model's own tokens are never re-tokenised; a finished episode leaves the cache, and each row reads exactly its
own conversation (sliding windows included: the engine counts them in the row's own positions). This module only
orchestrates turns and tools.

Limits, as TRL's:
- `generation.max_new_tokens` bounds the whole completion, the policy's turns and the tool results and headers
  between them (TRL's `max_completion_length`): a turn samples at most what is left, and tool results whose suffix
  would take the completion past it are dropped (the calls ran and count; the episode ends after the turn that made
  them, its completion as it was), as are results past the model's `max_position_embeddings`.
- `max_calls` (TRL's `max_tool_calling_iterations`) bounds the rounds of tool execution: the calls of the turn after
  the last round are not run, and the episode ends there.
- A turn cut by the length limit (no EOS) runs none of its calls.
- A turn a stop string ended (`generation.stop_strings`) ended as one with EOS does: its calls run, and the template's
  end-of-turn token (EOS) is appended before their results, as a token the policy did not sample (action mask 0).

Counted per episode (`ToolCounts`): calls run, failures (raised, timed out, unprintable), timeouts, malformed calls
(a finished turn that does not parse counts one; a call naming no tool or with arguments that do not fit counts one,
is not run, and gets its error message as the tool result), assistant turns, and calls per tool; and per turn whether
it is well formed (it ended with EOS, and every call in it parsed and fits a tool): format accuracy's evidence.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.errors import TemplateError, UserError
from rlhfkit.generation import Group, Session, Stream, Turn, sampling_mode, seeded_generator, stop_strings
from rlhfkit.rollout import is_nonfinite_sampling, prompt_seeds
from rlhfkit.templates import Support, support
from rlhfkit.tools import Call, Toolbox, Tool, cap_result, resolve, run_calls
from rlhfkit.types import PromptBatch, Rollout, Rows, ToolCounts


@dataclass
class Episode:
    """One episode as it grows: its tokens, which of them the policy chose, what reward functions will read."""

    prompt_ids: list[int]
    tools: dict[str, Tool]
    schemas: list[dict] | None  # what the template renders and the parser casts with (None: no tools)
    environment: object = None
    environment_name: object = None  # its key in a dict environment_factory (None: a single factory)
    prompt: object = None  # the prompt as played: the record's, an environment's reset() text appended
    ids: list[int] = field(default_factory=list)  # the completion: the policy's turns, tool results, headers
    action: list[int] = field(default_factory=list)  # 1 on the tokens the policy sampled
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each sampled token, 0 elsewhere
    messages: list[dict] = field(default_factory=list)  # TRL's completion: assistant turns and tool messages
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    malformed: int = 0
    turns: int = 0
    per_tool: dict[str, int] = field(default_factory=dict)
    well_formed: list[bool] = field(default_factory=list)  # per turn: it ended and all its calls parse and fit a tool
    ended: bool = False  # its last turn ended by itself (EOS or a stop string), not cut by the length limit

    def budget(self, max_new_tokens: int) -> int:
        return max_new_tokens - len(self.ids)


class ToolLoop:
    """`RolloutMaker` of multi-turn episodes with tools (module docstring).

    Each prompt row is rendered here, with the tools' schemas (the chat template's own rendering) and, with an
    `environment_factory`, after its episode's environment was `reset(**row)`: a string it returns is appended to the
    prompt's last message, as TRL does. A text prompt becomes one user message. The rollout's `prompt_ids` are these
    rendered prompts; the `PromptBatch` given only seeds the sampling (`generation.seed_per_prompt`)."""

    def __init__(self, tokenizer, params: GenerationConfig, seed: int, toolbox: Toolbox, max_calls: int | None,
                 timeout_s: float, max_result_tokens: int):
        """`max_calls`: rounds of tool execution per episode, None for no limit but the length (every round appends
        at least one token, so an episode ends); `timeout_s`, `max_result_tokens`: each call's (`rlhfkit.tools`)."""
        if params.engine != "rlhfkit" or params.compile:
            raise UserError("tools: the tool loop samples with rlhfkit's own decode loop and a dynamic KV cache; set "
                            "generation.engine: rlhfkit and generation.compile: false")
        if max_calls is not None and max_calls < 1:
            raise UserError(f"tools.max_calls must be at least 1, got {max_calls}")
        check_tool_template(tokenizer, toolbox)
        self.tokenizer, self.params, self.seed, self.toolbox = tokenizer, params, seed, toolbox
        self.max_calls, self.timeout_s, self.max_result_tokens = max_calls, timeout_s, max_result_tokens

    def __call__(self, policy, prompts: PromptBatch, examples: list[dict], step: int) -> Rollout | None:
        k = self.params.num_samples
        episodes = self.start([e for e in examples for _ in range(k)])
        seeds = prompt_seeds(self.seed, step, prompts, self.params.seed_per_prompt)
        device = prompts.input_ids.device
        shared = Stream()
        streams = [Stream(seeded_generator(s, device)) for s in seeds] if seeds else [shared] * len(examples)
        # A prompt's samples wait, and join the session, together: its stream's draws are then those of every row
        # at once (`play`).
        waiting = collections.deque([Group([i], episodes[i].prompt_ids, streams[p], 0)
                                     for i in range(p * k, (p + 1) * k)] for p in range(len(examples)))
        try:
            with sampling_mode(policy):
                self.play(policy, episodes, waiting, device)
        except RuntimeError as exc:
            if is_nonfinite_sampling(exc):
                return None
            raise
        return self.rollout(episodes, k, device)

    def start(self, rows: list[dict]) -> list[Episode]:
        """An episode per row: its environment taken and reset, its tools, its prompt rendered with them."""
        fields = [{"prompt": r["prompt"], **r.get("columns", {})} for r in rows]
        envs = self.toolbox.environments.take(fields) if self.toolbox.environments else [(None, None)] * len(rows)
        episodes = []
        for listed, row, (name, env) in zip([r.get("tools") for r in rows], fields, envs):
            messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
            played = row["prompt"]
            if env is not None:
                observation = env.reset(**self.toolbox.environments.reset_arguments(row))
                if isinstance(observation, str):
                    messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]
                    played = messages if isinstance(played, list) else played + observation
            # A record's own `tools` column: only the tools it names, shown as it describes them (as SFT shows it).
            # None, not []: some templates render boilerplate for [].
            tools = self.toolbox.episode_tools(env, name, listed)
            schemas = (listed if listed is not None else [t.schema for t in tools.values()]) or None
            ids = self.tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            episodes.append(Episode(list(ids), tools, schemas, env, name, prompt=played))
        return episodes

    def play(self, policy, episodes: list[Episode], waiting: collections.deque, device) -> None:
        """Plays the episodes to their end in one session of the engine, `generation.max_batch_rows` rows at most (all:
        null). A round samples a turn of every episode in the session, runs their calls and appends the results; at
        its end the episodes that ended leave, and waiting prompts' episodes (`waiting`: one `Group` per episode, a
        deque of prompts) join while there is room for all of a prompt's: continuous refill, a round at a time."""
        tok, params = self.tokenizer, self.params
        room = params.max_batch_rows or len(episodes)
        session = Session(policy, params, tok.eos_token_id, tok.pad_token_id, device, stop_strings(params, tok))
        live = admit(waiting, room)
        session.start(live)
        live = [g.keys[0] for g in live]  # the episodes of the session's rows, in order
        limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        while live:
            turns = session.sample([episodes[i].budget(params.max_new_tokens) for i in live], keep_finished=True)
            calls = [self.end_turn(episodes[i], turns[i]) for i in live]
            # The calls of the turn after the last round of tool execution (tools.max_calls) are not run.
            calls = [c if self.max_calls is None or episodes[i].turns <= self.max_calls else None
                     for i, c in zip(live, calls)]
            keep, chunks = [], []
            for row, (i, called, results) in enumerate(zip(live, calls, run_calls([c or [] for c in calls],
                                                                                   self.timeout_s))):
                suffix = self.record_calls(episodes[i], called, results, limit) if called else None
                if suffix and episodes[i].budget(params.max_new_tokens) > 0:
                    keep.append(row)
                    chunks.append(suffix)
            if keep:
                session.extend(keep, chunks)
            live = [live[row] for row in keep]
            joining = admit(waiting, room - len(live))
            if joining and live:
                session.join(joining)
            elif joining:
                session.start(joining)
            live += [g.keys[0] for g in joining]

    def end_turn(self, ep: Episode, turn: Turn) -> list[Call] | None:
        """Appends a sampled turn to `ep`, its parsed message to `ep.messages`; the turn's calls resolved against the
        episode's tools, or None when it calls nothing (or was cut by the length limit)."""
        tok, ids = self.tokenizer, turn.ids
        prefix = ep.prompt_ids + ep.ids
        ep.ids += ids
        ep.action += [1] * len(ids)
        ep.logprobs += turn.logprobs
        ep.turns += 1
        finished = ep.ended = turn.ended(tok.eos_token_id)
        try:
            message = tok.parse_response(ids, prefix=prefix, tools=ep.schemas)
        except (ValueError, TypeError):  # transformers raises on a region it cannot parse: a malformed call
            message = None
        if message is None:
            ep.malformed += finished
            ep.well_formed.append(False)
            ep.messages.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
            return None
        message = {**message, "content": (message.get("content") or "").removesuffix(tok.eos_token)}
        ep.messages.append(message)
        if not finished or not message.get("tool_calls"):
            ep.well_formed.append(finished)
            return None
        calls = [resolve(*_name_and_arguments(c), ep.tools) for c in message["tool_calls"]]
        ep.malformed += sum(c.tool is None for c in calls)
        ep.well_formed.append(all(c.tool is not None for c in calls))
        return calls

    def record_calls(self, ep: Episode, calls: list[Call], results, limit: int | None) -> list[int] | None:
        """Counts the calls and their outcomes; appends the tool messages and the suffix the template renders for
        them (returned), or None when the suffix does not fit (the messages are then dropped, the counts kept)."""
        messages = []
        for call, outcome in zip(calls, results):
            if call.tool is not None:  # (a malformed call was counted when its turn was parsed)
                ep.calls += 1
                ep.per_tool[call.name] = ep.per_tool.get(call.name, 0) + 1
                ep.failures += outcome.failed
                ep.timeouts += outcome.timed_out
                if outcome.timed_out and getattr(call.tool.fn, "__self__", None) is ep.environment is not None:
                    self.toolbox.environments.discard(ep.environment_name, ep.environment)  # its call may still run
            content = cap_result(outcome.content, self.tokenizer, self.max_result_tokens)
            messages.append({"role": "tool", "name": call.name, "content": content})
        # A turn a stop string ended has no end-of-turn token: the template's (EOS) goes first, not sampled.
        eos = self.tokenizer.eos_token_id
        suffix = ([] if ep.ids[-1] == eos else [eos]) + tool_suffix(self.tokenizer, messages)
        total = len(ep.prompt_ids) + len(ep.ids) + len(suffix)
        if len(ep.ids) + len(suffix) > self.params.max_new_tokens or (limit is not None and total >= limit):
            return None
        ep.messages += messages
        ep.ids += suffix
        ep.action += [0] * len(suffix)
        ep.logprobs += [0.0] * len(suffix)
        return suffix

    def rollout(self, episodes: list[Episode], k: int, device) -> Rollout:
        """The episodes as one `Rollout`: prompts left-padded, completions right-padded, decoded once."""
        tok, pad = self.tokenizer, self.tokenizer.pad_token_id
        width_p = max(len(e.prompt_ids) for e in episodes)
        width_r = max(max(len(e.ids) for e in episodes), 1)
        left = lambda xs, v: [v] * (width_p - len(xs)) + xs  # noqa: E731
        right = lambda xs, v: xs + [v] * (width_r - len(xs))  # noqa: E731
        as_tensor = lambda rows, dtype=torch.long: torch.tensor(rows, dtype=dtype, device=device)  # noqa: E731
        response_mask = as_tensor([right([1] * len(e.ids), 0) for e in episodes])
        names = self.toolbox.names
        counts = ToolCounts(
            calls=as_tensor([e.calls for e in episodes]), failures=as_tensor([e.failures for e in episodes]),
            timeouts=as_tensor([e.timeouts for e in episodes]), malformed=as_tensor([e.malformed for e in episodes]),
            turns=as_tensor([e.turns for e in episodes]),
            per_tool=as_tensor([[e.per_tool.get(n, 0) for n in names] for e in episodes]).reshape(len(episodes), len(names)),
            tool_names=names, well_formed=Rows(tuple(e.well_formed) for e in episodes))
        return Rollout(
            prompt_ids=as_tensor([left(e.prompt_ids, pad) for e in episodes]),
            prompt_mask=as_tensor([left([1] * len(e.prompt_ids), 0) for e in episodes]),
            response_ids=as_tensor([right(e.ids, pad) for e in episodes]),
            response_mask=response_mask,
            group_ids=torch.arange(len(episodes) // k, device=device).repeat_interleave(k),
            has_eos=as_tensor([e.ended for e in episodes], torch.bool),
            sampler_logprobs=as_tensor([right(e.logprobs, 0.0) for e in episodes], torch.float32),
            action_mask=as_tensor([right(e.action, 0) for e in episodes]),
            texts=Rows(tok.batch_decode([e.ids for e in episodes], skip_special_tokens=True)),
            completions=Rows(e.messages for e in episodes),
            environments=Rows(e.environment for e in episodes) if self.toolbox.environments else None,
            prompts=Rows(e.prompt for e in episodes) if self.toolbox.environments else None,
            tools=counts,
            schemas=Rows(e.schemas for e in episodes),
        )


def admit(waiting: collections.deque, room: int) -> list[Group]:
    """The episodes of the waiting prompts that fit in `room` rows, whole prompts in order."""
    joining = []
    while waiting and len(waiting[0]) <= room:
        room -= len(waiting[0])
        joining += waiting.popleft()
    return joining


def _name_and_arguments(call) -> tuple:
    """(name, arguments) of a parsed tool call ({"type": "function", "function": {"name", "arguments"}}); None for
    what is missing, which `tools.resolve` reports as malformed."""
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    return fn.get("name"), fn.get("arguments")


def tool_suffix(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the chat template renders after an assistant turn that called tools: its tool messages, then the
    next assistant header. Rendered after a stand-in assistant turn (the suffix does not depend on its content), the
    stand-in's own tokens cut at their last EOS, the point where a sampled turn ends; the template must render the
    longer conversation as an extension of the shorter (prefix-preserving), else a TemplateError."""
    stand_in = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
    render = lambda messages, header: list(tokenizer.apply_chat_template(  # noqa: E731
        messages, add_generation_prompt=header, tokenize=True, return_dict=False))
    before, after = render(stand_in, False), render(stand_in + tool_messages, True)
    ends = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    before = before[: ends[-1] + 1] if ends else before
    if after[: len(before)] != before:
        raise TemplateError(f"tools: {Support.NEEDS['prefix_preserving']}, so results cannot be appended to the sampled "
                            "tokens; use a prefix-preserving template (model.chat_template: chatml_tools)")
    return after[len(before):]


def check_tool_template(tokenizer, toolbox: Toolbox) -> None:
    """A one-line `TemplateError` unless the tokenizer can run the loop (`templates.support`): a chat template that
    renders the tools' schemas, the calls and their results as an extension of the turn before them, and a
    `response_template` that parses the model's calls back."""
    methods = [t for env in (toolbox.environments.methods.values() if toolbox.environments else ()) for t in env.values()]
    schemas = [t.schema for t in list(toolbox.functions.values()) + methods]
    support(tokenizer).require("template", *(["tools"] if schemas else []), "calls", "results", "prefix_preserving",
                               "parses_calls", where="tools",
                               fix="set model.chat_template: chatml_tools (a bundled template with tools and their parsing)")
