"""The multi-turn rollout with tools: episodes in which the policy calls the run's tools (`rlhfkit.tools`) and reads
their results, under TRL 1.16's contract (`GRPOTrainer(tools=..., environment_factory=...)`).

One step's episodes are batched. Each turn, every live episode samples an assistant turn from rlhfkit's decode loop
(`generation.sample_next`); each finished turn is parsed by transformers' response parsing (the tokenizer's
`response_template`, arguments cast to the tools' schemas); the calls run (`tools.run_calls`: episodes concurrently);
their results and the next assistant header are appended as the chat template renders them (`tool_suffix`), and only
the episodes that called a tool go on. The KV cache is kept across turns: a turn feeds only the tokens appended since
the last (the tool results and the header), never the conversation again, and the model's own tokens are never
re-tokenised. The cache's rows are the live episodes: a finished one is dropped from it, and the columns a row did not
fill (its left padding, the steps after its turn ended while others went on) are masked out of attention, the
positions counting real tokens only, so a row reads exactly its own conversation.

Limits, as TRL's:
- `generation.max_new_tokens` bounds the whole completion, the policy's turns and the tool results and headers
  between them (TRL's `max_completion_length`): a turn samples at most what is left, and tool results whose suffix
  would take the completion past it are dropped (the calls ran and count; the episode ends after the turn that made
  them, its completion as it was), as are results past the model's `max_position_embeddings`.
- `max_calls` (TRL's `max_tool_calling_iterations`) bounds the rounds of tool execution: the calls of the turn after
  the last round are not run, and the episode ends there.
- A turn cut by the length limit (no EOS) runs none of its calls.

Counted per episode (`ToolCounts`): calls run, failures (raised, timed out, unprintable), timeouts, malformed calls
(a finished turn that does not parse counts one; a call naming no tool or with arguments that do not fit counts one,
is not run, and gets its error message as the tool result), assistant turns, and calls per tool; and per turn whether
it is well formed (it ended with EOS, and every call in it parsed and fits a tool): format accuracy's evidence.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlhfkit.config import GenerationConfig
from rlhfkit.errors import TemplateError, UserError
from rlhfkit.generation import _cache_argument, sample_next, seeded
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

    @torch.no_grad()
    def __call__(self, policy, prompts: PromptBatch, examples: list[dict], step: int) -> Rollout | None:
        check_attention(policy)
        k = self.params.num_samples
        episodes = self.start([e for e in examples for _ in range(k)])
        seeds = prompt_seeds(self.seed, step, prompts, self.params.seed_per_prompt)
        groups = [list(range(g * k, (g + 1) * k)) for g in range(len(examples))] if seeds else [list(range(len(episodes)))]
        was_training = policy.training
        policy.eval()  # no dropout while sampling (and gradient checkpointing would turn the KV cache off)
        try:
            for g, rows in enumerate(groups):
                with seeded(seeds[g]) if seeds else contextlib.nullcontext():
                    self.play(policy, [episodes[i] for i in rows], prompts.input_ids.device)
        except RuntimeError as exc:
            if is_nonfinite_sampling(exc):
                return None
            raise
        finally:
            policy.train(was_training)
        return self.rollout(episodes, k, prompts.input_ids.device)

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

    def play(self, policy, episodes: list[Episode], device) -> None:
        """Plays `episodes` to their end, batched, the KV cache kept across turns (module docstring)."""
        tok, params = self.tokenizer, self.params
        session = Session(policy, params, tok.eos_token_id, tok.pad_token_id, device)
        logits = session.start([e.prompt_ids for e in episodes])
        live = list(range(len(episodes)))  # the episodes of the session's rows, in order
        limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        for round_ in itertools.count():
            turns = session.sample_turn(logits, [episodes[i].budget(params.max_new_tokens) for i in live])
            calls = [self.end_turn(episodes[i], ids, lps) for i, (ids, lps) in zip(live, turns)]
            if round_ == self.max_calls:
                break
            outcomes = run_calls([c or [] for c in calls], self.timeout_s)
            keep, chunks = [], []
            for row, (i, called, results) in enumerate(zip(live, calls, outcomes)):
                if not called:
                    continue
                suffix = self.record_calls(episodes[i], called, results, limit)
                if suffix and episodes[i].budget(params.max_new_tokens) > 0:
                    keep.append(row)
                    chunks.append(suffix)
            if not keep:
                break
            logits = session.extend(keep, chunks)
            live = [live[row] for row in keep]

    def end_turn(self, ep: Episode, ids: list[int], logprobs: list[float]) -> list[Call] | None:
        """Appends a sampled turn to `ep`, its parsed message to `ep.messages`; the turn's calls resolved against the
        episode's tools, or None when it calls nothing (or was cut by the length limit)."""
        tok = self.tokenizer
        prefix = ep.prompt_ids + ep.ids
        ep.ids += ids
        ep.action += [1] * len(ids)
        ep.logprobs += logprobs
        ep.turns += 1
        finished = bool(ids) and ids[-1] == tok.eos_token_id
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
        suffix = tool_suffix(self.tokenizer, messages)
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
            has_eos=as_tensor([bool(e.ids) and e.ids[-1] == tok.eos_token_id for e in episodes], torch.bool),
            sampler_logprobs=as_tensor([right(e.logprobs, 0.0) for e in episodes], torch.float32),
            action_mask=as_tensor([right(e.action, 0) for e in episodes]),
            texts=Rows(tok.batch_decode([e.ids for e in episodes], skip_special_tokens=True)),
            completions=Rows(e.messages for e in episodes),
            environments=Rows(e.environment for e in episodes) if self.toolbox.environments else None,
            prompts=Rows(e.prompt for e in episodes) if self.toolbox.environments else None,
            tools=counts,
        )


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


def sliding_window_of(config) -> int | None:
    """The window of a model's sliding-window attention layers (Mistral's, Gemma 2's alternate layers, Qwen2's with
    `use_sliding_window`), or None when every layer attends to the whole sequence."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    return None if not window or (types is not None and "sliding_attention" not in types) else int(window)


def check_attention(policy) -> None:
    """A one-line UserError for a policy with sliding-window attention: transformers counts the window in cache
    columns, and a row's columns here include the masked ones of other rows' longer turns and chunks, so inside the
    window they would displace real tokens and the sampled log-probs would not be the trainer's (see
    tests/unit/test_tool_loop_sliding_window.py)."""
    config = getattr(policy, "config", None)
    window = sliding_window_of(config)
    if window is not None:
        raise UserError(f"tools: the policy ({config.model_type}) uses sliding-window attention ({window} tokens), "
                        "which the tool loop's KV cache, shared by the episodes across turns, cannot keep exact; use a "
                        "model without one (for Mistral, sliding_window: null in its config.json, as v0.2 and later ship)")


class Session:
    """The KV cache of a batch of episodes across their turns (module docstring).

    `mask` (n, W) marks the cache columns each row reads (1: one of its real tokens), `next_position` (n,) the position
    of each row's next real token, `unfed` the tokens each row sampled last that the cache has not seen yet (a turn's
    final token: the loop stops before feeding it)."""

    def __init__(self, model, params: GenerationConfig, eos_token_id: int, pad_token_id: int, device):
        self.model, self.params, self.eos, self.pad, self.device = model, params, eos_token_id, pad_token_id, device
        self.cache = DynamicCache(config=model.config)
        # Full-attention layers grow in place (`GrowingLayer`); others (a model's linear-attention ones) are kept.
        self.cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.cache.layers]
        self.arg = _cache_argument(model)
        self.mask = self.next_position = None
        self.unfed: list[list[int]] = []

    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Feeds (n, S) tokens, `real` (n, S) marking the rows' real ones; -> the last position's logits (n, V)."""
        positions = self.next_position[:, None] + real.long().cumsum(1) - real.long()  # (n, S)
        self.mask = torch.cat([self.mask, real.long()], 1) if self.mask is not None else real.long()
        self.next_position = self.next_position + real.long().sum(1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.arg: self.cache})
        return out.logits[:, -1].float()

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefills the prompts, left-padded; -> (n, V) logits of each row's next token. A prompt several rows share
        (a GRPO group's) is prefilled once and its cache row copied to each: a row's numbers do not depend on the rows
        beside it, so each row holds what its own prefill would have written, and the prefill costs one row per
        distinct prompt."""
        distinct = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prompts)))}  # prompt -> its prefill row
        self.next_position = torch.zeros(len(distinct), dtype=torch.long, device=self.device)
        self.unfed = [[] for _ in prompts]
        logits = self.forward(*self._left_padded([list(p) for p in distinct]))
        if len(distinct) < len(prompts):
            index = torch.tensor([distinct[tuple(p)] for p in prompts], device=self.device)
            self._keep(index)
            logits = logits[index]
        return logits

    def extend(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Keeps the session's `rows` only and feeds each its unfed token and then its chunk; -> (len(rows), V)."""
        self._keep(torch.tensor(rows, device=self.mask.device))
        chunks = [self.unfed[r] + c for r, c in zip(rows, chunks)]
        self.unfed = [[] for _ in rows]
        return self.forward(*self._left_padded(chunks))

    def _keep(self, index: torch.Tensor) -> None:
        """The cache's rows `index` (k,) become its rows: a subset, or rows copied."""
        self.cache.batch_select_indices(index)
        self.mask, self.next_position = self.mask[index], self.next_position[index]

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[self.pad] * (width - len(s)) + s for s in seqs], device=self.device)
        real = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        return ids, real

    def sample_turn(self, logits: torch.Tensor, budgets: list[int]) -> list[tuple[list[int], list[float]]]:
        """Samples one turn per row, until its EOS or its `budget` tokens; -> (tokens, log-probs) per row. A row that
        finished is fed pad tokens while others go on, masked out of attention (its cache columns hold no token)."""
        n = len(budgets)
        limit = torch.tensor(budgets, device=logits.device)
        count = torch.zeros(n, dtype=torch.long, device=logits.device)
        done = limit <= 0
        tokens, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        while True:
            token, logprob = sample_next(logits, self.params)  # (n,), (n,)
            active = ~done
            for r in active.nonzero().flatten().tolist():
                tokens[r].append(int(token[r]))
                logprobs[r].append(float(logprob[r]))
            count = count + active.long()
            done = done | (token == self.eos) | (count >= limit)
            if bool(done.all()):
                self.unfed = [[tokens[r][-1]] if bool(active[r]) else [] for r in range(n)]
                return list(zip(tokens, logprobs))
            logits = self.forward(token.masked_fill(~active, self.pad)[:, None], active[:, None])


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with room to grow, doubled when full: a step writes
    its column in place, where `DynamicLayer.update` copies the whole layer (`torch.cat`) at every token, a cost that
    grows with the conversation. The views hold the same values, so attention reads the same numbers. Supports what
    `Session` does to its cache: `update` and `batch_select_indices`."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (batch, heads, capacity, head_dim) each
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            self.buffers = tuple(self._grown(old, new, max(end, 2 * self.length))
                                 for old, new in zip(self.buffers or (None, None), (key_states, value_states)))
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[..., self.length:end, :] = states
        self.length = end
        self.keys, self.values = (b[..., :end, :] for b in self.buffers)
        return self.keys, self.values

    def _grown(self, old: torch.Tensor | None, states: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (*states.shape[:-2], capacity, states.shape[-1])
        grown = torch.empty(shape, dtype=states.dtype, device=states.device)
        if old is not None:
            grown[..., : self.length, :] = old[..., : self.length, :]
        return grown

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self.buffers = tuple(b[indices] for b in self.buffers)
            self.keys, self.values = (b[..., : self.length, :] for b in self.buffers)
