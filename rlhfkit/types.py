"""The shape alphabet and the typed batches passed between modules.

Shape alphabet (used in `# (B, T)` comments throughout the package):
    B  batch (sequences in a micro-batch)      T  sequence length (prompt + response)
    P  prompt length                            R  response length
    V  vocabulary size                          G  group size (samples per prompt)
    H  hidden size                              N  number of tokens (flattened)

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


class Rows(tuple):
    """Per-row Python values of a batch (texts, message lists, environment objects): `select` picks their rows as it
    picks a tensor's, `to` leaves them as they are."""


def _rows(value: Rows, rows) -> Rows:
    if isinstance(rows, slice):
        return Rows(value[rows])
    return Rows(value[i] for i in rows.tolist())


class _TensorBatch:
    """Moves every tensor field to a device; dataclasses below inherit it."""

    def to(self, device: torch.device | str):
        kwargs = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kwargs[f.name] = value.to(device) if isinstance(value, (torch.Tensor, _TensorBatch)) else value
        return type(self)(**kwargs)

    def select(self, rows):
        """The batch's rows `rows` (a slice, or a (K,) index tensor) of every tensor field, first dimension."""
        kwargs = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kwargs[f.name] = value[rows] if isinstance(value, torch.Tensor) else (
                value.select(rows) if isinstance(value, _TensorBatch) else _rows(value, rows) if isinstance(value, Rows)
                else value)
        return type(self)(**kwargs)


@dataclass
class SFTBatch(_TensorBatch):
    """Right-padded language-modelling batch; labels are -100 where no loss is taken (prompt, padding)."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    labels: torch.Tensor  # (B, T) long, -100 = ignored


@dataclass
class PreferenceBatch(_TensorBatch):
    """Pairs of (prompt + chosen) and (prompt + rejected), each right-padded to a common length T.

    `chosen_labels`/`rejected_labels` are -100 on the prompt and padding, so they mark the response tokens.
    `margin` is an optional per-pair margin (Llama 2's RM margin loss); zeros when the data has none.
    """

    chosen_input_ids: torch.Tensor  # (B, T)
    chosen_attention_mask: torch.Tensor  # (B, T)
    chosen_labels: torch.Tensor  # (B, T)
    rejected_input_ids: torch.Tensor  # (B, T)
    rejected_attention_mask: torch.Tensor  # (B, T)
    rejected_labels: torch.Tensor  # (B, T)
    margin: torch.Tensor  # (B,) float


@dataclass
class PaddingFreeBatch(_TensorBatch):
    """S sequences end to end in ONE row of N = Σ lengths tokens (`data.padding_free`): no padding, no attention mask.

    `position_ids` restart at 0 at each sequence; from them transformers builds a block-diagonal causal mask
    (`masking_utils.find_packed_sequence_indices`, or cu_seqlens for flash attention), so no token attends to another
    sequence and no pad token is computed. Unlike classic packing (`data.packing`), each sequence's outputs are exactly
    those of the sequence alone. Per-sequence results are summed back over `seq_ids`.
    """

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N) 0, 1, ..., len_s - 1 for each sequence s in turn
    labels: torch.Tensor  # (1, N) as the padded rows' labels: -100 where no loss is taken
    seq_lens: torch.Tensor  # (S,) long, each sequence's length

    @property
    def seq_ids(self) -> torch.Tensor:  # (N,) long: the sequence of each token
        return torch.repeat_interleave(torch.arange(len(self.seq_lens), device=self.seq_lens.device), self.seq_lens)

    @property
    def next_token_labels(self) -> torch.Tensor:  # (1, N): `labels`, -100 at each sequence's first token
        """The targets of a shifted next-token loss: no token predicts a sequence's first token (its left neighbour
        ends another sequence), as no token of a padded row predicts the row's first."""
        return self.labels.masked_fill(self.position_ids == 0, -100)


@dataclass
class PaddingFreePairs(_TensorBatch):
    """A `PreferenceBatch` without padding: its 2B sequences in one `PaddingFreeBatch`, the B prompt + chosen then the
    B prompt + rejected (the order of the padded path's concatenated forward, so results split back with `chunk(2)`)."""

    sequences: PaddingFreeBatch  # 2B sequences; labels -100 on the prompts
    margin: torch.Tensor  # (B,) float


@dataclass
class UnpairedBatch(_TensorBatch):
    """KTO batch: (prompt + completion) with a desirable/undesirable label, plus mismatched pairs for z0.

    `kl_*` hold each prompt paired with another example's completion (Ethayarajh et al. 2024, §4.1): the
    reference point z0 is estimated from them.
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 outside the completion
    desirable: torch.Tensor  # (B,) bool
    kl_input_ids: torch.Tensor  # (B, T')
    kl_attention_mask: torch.Tensor  # (B, T')
    kl_labels: torch.Tensor  # (B, T')


@dataclass
class PromptBatch(_TensorBatch):
    """Left-padded prompts for generation."""

    input_ids: torch.Tensor  # (B, P)
    attention_mask: torch.Tensor  # (B, P)


@dataclass(frozen=True)
class ToolCounts(_TensorBatch):
    """What a multi-turn rollout with tools did in each episode (`rollout.tool_loop`); (B,) long each."""

    calls: torch.Tensor  # (B,) well-formed tool calls, executed
    failures: torch.Tensor  # (B,) executed calls whose tool raised, timed out or returned what cannot be printed
    timeouts: torch.Tensor  # (B,) of the failures, those that ran past tools.timeout_s
    malformed: torch.Tensor  # (B,) calls that did not parse, named no known tool or did not fit its schema: not run
    turns: torch.Tensor  # (B,) assistant turns in the episode
    per_tool: torch.Tensor  # (B, K) executed calls of each tool, in the order of `tool_names`
    tool_names: tuple[str, ...] = ()  # the K registered tools (the same on every row)
    # (B,) per episode, one bool per assistant turn in the order of its completion's assistant messages: the turn ended
    # (EOS) and every call in it parsed and fits a tool (format accuracy, `evaluation.agent`). Each process's own rows:
    # a gather of the tensors above leaves it as it is.
    well_formed: Rows | None = None

    @staticmethod
    def concat(parts: list["ToolCounts"]) -> "ToolCounts":
        """The counts of several rollouts as one, rows in order (the tools are the same in each)."""
        tensors = {f.name: torch.cat([getattr(c, f.name) for c in parts]) for f in fields(ToolCounts)
                   if isinstance(getattr(parts[0], f.name), torch.Tensor)}
        well_formed = Rows(r for c in parts for r in c.well_formed) if all(c.well_formed is not None for c in parts) \
            else None
        return ToolCounts(**tensors, tool_names=parts[0].tool_names, well_formed=well_formed)


@dataclass(frozen=True)
class ToolFigures:
    """The tool figures of a set of episodes, from their `ToolCounts` (every process's rows, gathered by the caller):
    the one definition training logs (`tools/...`, with TRL 1.16's two names as aliases of the same numbers) and
    evaluation reports (`agent/...`, eval.json's `agent` section).

    A call is any call the policy made: run, or malformed (it did not parse, named no tool of its episode or did not
    fit the tool's schema: not run). A failure is a call that gave no result: a run that raised, timed out or returned
    what cannot be printed, or a malformed call. Malformed calls therefore count, as calls and as failures, on both
    sides: TRL runs an unknown name or refused arguments and counts the call failed; here such a call is not run, and a
    finished turn that does not parse counts one malformed call, which TRL does not see.
    """

    episodes: int
    turns: int  # assistant turns
    calls: int  # every call the policy made: run + malformed
    failures: int  # calls without a result: failed runs + malformed
    malformed: int  # calls not run
    timeouts: int  # runs past tools.timeout_s (among the failures)
    per_tool: tuple[tuple[str, int], ...] = ()  # (tool, runs of it) in the toolbox's order

    # TRL 1.16's metric names -> ours: training logs both, the same number under each
    TRL_NAMES = {"call_frequency": "calls_per_episode", "failure_frequency": "failures_per_call"}

    @classmethod
    def of(cls, counts: ToolCounts) -> "ToolFigures":
        malformed = int(counts.malformed.sum())
        return cls(episodes=int(counts.calls.numel()), turns=int(counts.turns.sum()),
                   calls=int(counts.calls.sum()) + malformed, failures=int(counts.failures.sum()) + malformed,
                   malformed=malformed, timeouts=int(counts.timeouts.sum()),
                   per_tool=tuple((name, int(counts.per_tool[:, k].sum())) for k, name in enumerate(counts.tool_names)))

    def as_dict(self) -> dict[str, float]:
        """The shares: per episode (0 without episodes) and per call (0 without calls), and each tool's runs per
        episode under `calls_per_episode/<tool>`."""
        per_episode = lambda n: n / self.episodes if self.episodes else 0.0  # noqa: E731
        per_call = lambda n: n / self.calls if self.calls else 0.0  # noqa: E731
        out = {"calls_per_episode": per_episode(self.calls), "failures_per_call": per_call(self.failures),
               "malformed_per_call": per_call(self.malformed), "timeouts_per_call": per_call(self.timeouts),
               "turns_per_episode": per_episode(self.turns)}
        out.update({f"calls_per_episode/{name}": per_episode(n) for name, n in self.per_tool})
        return out

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        """`as_dict` under `prefix`, with TRL's names beside ours (a TRL user's dashboard reads tools/call_frequency)."""
        figures = self.as_dict()
        out = {prefix + k: v for k, v in figures.items()}
        out.update({prefix + trl: figures[ours] for trl, ours in self.TRL_NAMES.items()})
        return out


@dataclass(frozen=True)
class Rollout(_TensorBatch):
    """Sampled responses to left-padded prompts, one row per sample (prompt i's k samples are adjacent).

    Sequence layout: [left padding, prompt | response, right padding]; the full sequence is
    `torch.cat([prompt_ids, response_ids], 1)` with mask `torch.cat([prompt_mask, response_mask], 1)`.

    The response is the whole completion: in a multi-turn episode with tools, the policy's turns and, between them,
    the tool results and headers the chat template renders. `response_mask` marks its real tokens (what attention
    reads); `action_mask` the tokens the policy chose, the only ones that take a log-prob in any loss, KL, entropy,
    value loss or length figure. Single-turn, the two are equal.
    """

    # what was sampled
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) long
    response_ids: torch.Tensor  # (B, R) right-padded with pad_token_id after the completion's last token
    response_mask: torch.Tensor  # (B, R) long: the completion's real tokens (single-turn: up to and including EOS)
    group_ids: torch.Tensor  # (B,) long: index of the prompt in the rollout batch
    has_eos: torch.Tensor  # (B,) bool: the completion ended by itself, at EOS or a stop string (not cut at a limit)
    # log-probs of the sampled tokens as the sampler saw them (for the sampler/trainer gap metric only)
    sampler_logprobs: torch.Tensor  # (B, R) fp32, 0 outside the action tokens
    action_mask: torch.Tensor  # (B, R) long: 1 on the tokens the policy chose (a subset of response_mask)
    # The text, decoded once by the rollout component (None where a caller made the rollout without one):
    texts: Rows | None = None  # (B,) each completion's text, special tokens skipped
    completions: Rows | None = None  # (B,) what reward functions get: the text, or a message list (TRL's contract)
    environments: Rows | None = None  # (B,) each episode's environment object (`environment_factory`), or None
    # (B,) each row's prompt as played, where it differs from its record's: an environment's `reset()` text appended
    # to the last message (TRL's contract: reward sources get it); None: the records' prompts
    prompts: Rows | None = None
    tools: ToolCounts | None = None  # what the episodes' tool calls did; None without tools
    # (B,) the tool schemas each row's prompt was rendered with (None in a row: none), for a reward model that renders
    # the episode again in its own tokens; None: no row was shown tools
    schemas: Rows | None = None

    @staticmethod
    def concat(parts: list["Rollout"], pad_token_id: int) -> "Rollout":
        """Several rollouts as one, rows in order: the one way to join rollouts (sampling batches, one prompt's
        draws). Prompts left-padded and responses right-padded to the widest (padding columns carry nothing: mask 0,
        log-prob 0), group ids continued after each part's last, and the per-row text, completions, environments,
        played prompts, schemas and tool counts kept wherever every part has them."""
        if len(parts) == 1:
            return parts[0]
        P, R = max(r.prompt_ids.shape[1] for r in parts), max(r.response_ids.shape[1] for r in parts)
        left = lambda t, v: torch.nn.functional.pad(t, (P - t.shape[1], 0), value=v)  # noqa: E731
        right = lambda t, v: torch.nn.functional.pad(t, (0, R - t.shape[1]), value=v)  # noqa: E731
        offsets = [0]
        for r in parts[:-1]:
            offsets.append(offsets[-1] + (int(r.group_ids.max()) + 1 if r.group_ids.numel() else 0))
        rows = {name: Rows(row for r in parts for row in getattr(r, name))
                for name in ("texts", "completions", "environments", "prompts", "schemas")
                if all(getattr(r, name) is not None for r in parts)}
        return Rollout(
            prompt_ids=torch.cat([left(r.prompt_ids, pad_token_id) for r in parts]),  # (B, P)
            prompt_mask=torch.cat([left(r.prompt_mask, 0) for r in parts]),
            response_ids=torch.cat([right(r.response_ids, pad_token_id) for r in parts]),  # (B, R)
            response_mask=torch.cat([right(r.response_mask, 0) for r in parts]),
            group_ids=torch.cat([r.group_ids + o for r, o in zip(parts, offsets)]),
            has_eos=torch.cat([r.has_eos for r in parts]),
            sampler_logprobs=torch.cat([right(r.sampler_logprobs, 0.0) for r in parts]),
            action_mask=torch.cat([right(r.action_mask, 0) for r in parts]),
            tools=ToolCounts.concat([r.tools for r in parts]) if all(r.tools is not None for r in parts) else None,
            **rows)

    def trimmed(self) -> "Rollout":
        """The same rows with the response columns cut to the longest response among them (at least 1): a micro-batch
        costs its own length, not the rollout's. Padding columns carry no information (mask 0, log-prob 0)."""
        width = max(int(self.response_mask.sum(1).max()), 1)
        return replace(self, response_ids=self.response_ids[:, :width], response_mask=self.response_mask[:, :width],
                       sampler_logprobs=self.sampler_logprobs[:, :width], action_mask=self.action_mask[:, :width])

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.prompt_mask, self.response_mask], 1)

    @property
    def sequence_response_mask(self) -> torch.Tensor:  # (B, P + R): 1 on the response tokens of `input_ids`
        return torch.cat([torch.zeros_like(self.prompt_mask), self.response_mask], 1)


@dataclass(frozen=True)
class Experience(_TensorBatch):
    """One online step's rollout with everything its updates read (rows as in `Rollout`).

    Built once, by `trainers.experience.ExperienceMaker.make`, and never changed; `select` gives a minibatch.
    """

    rollout: Rollout
    # no-grad forwards, without dropout, of the weights that sampled
    # (B, R) fp32 log π_old of the policy's tokens (the rollout's action mask), 0 elsewhere. None until the update when one pass is made over the
    # experience and no KL is in the reward: π_old is then the update forward's own (detached) log-probs.
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None  # (B, R) log π_ref, 0 off the action mask; None without a reference
    values: torch.Tensor | None  # (B, R) critic values V(s_t) at the policy's tokens; None without a critic
    # the learning signal
    scores: torch.Tensor  # (B,) raw rewards (before the EOS penalty and normalisation)
    shaped_scores: torch.Tensor  # (B,) after the EOS penalty, normalisation and clipping: what the advantages see
    kl: torch.Tensor | None  # (B,) sequence KL to the reference, Σ_t k1 over the policy's tokens; None without one
    advantages: torch.Tensor  # (B, R), 0 off the action mask
    returns: torch.Tensor  # (B, R) the critic's targets
    loss_mask: torch.Tensor  # (B, R) float: the tokens that take a loss (`advantages.loss_mask`)

    def trimmed(self) -> "Experience":
        """The same rows with every (B, R) tensor cut to the longest response among them (see `Rollout.trimmed`)."""
        rollout = self.rollout.trimmed()
        width = rollout.response_ids.shape[1]
        cut = lambda x: x[:, :width] if x is not None else None  # noqa: E731
        return Experience(rollout=rollout, old_logprobs=cut(self.old_logprobs), ref_logprobs=cut(self.ref_logprobs),
                          values=cut(self.values), scores=self.scores, shaped_scores=self.shaped_scores, kl=self.kl,
                          advantages=cut(self.advantages), returns=cut(self.returns), loss_mask=cut(self.loss_mask))
