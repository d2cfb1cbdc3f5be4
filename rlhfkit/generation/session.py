"""The decode engine: one KV cache over a batch of rows, which it prefills, extends by appended tokens, and samples
until EOS, a stop string (`stops`) or a budget. Every sampler in rlhfkit goes through it (`generation.generate` for
one turn, the tool loop for multi-turn episodes); it is the only place a model is called one token at a time.

The cache is transformers' `DynamicCache` (with `generation.compile`, a `StaticCache` and a compiled one-token step),
used through its public API only: the model's forward fills it, `batch_select_indices` keeps or copies rows, and a
cache is rebuilt from its tensors into new `DynamicLayer`s when rows join it (`rebuilt_cache`: a tensor at a time,
each old one released as its new one is filled, so one cache and one layer are live at the peak).

What the rows share (the efficiencies of the tool loop's session, now every caller's):
- a prompt several rows share (a group's) is prefilled once, its cache row then copied to each;
- a row that has finished leaves the cache (one turn: at once; a multi-turn episode: when its next turn is not
  wanted), so no forward is spent on it; only appended tokens are fed (a tool result, never the conversation again);
- continuous refill (`generation.max_batch_rows`): with more rows waiting than the batch holds, a group joins the
  cache as soon as finished rows leave room for it, instead of the batch idling until its longest row ends (one
  turn: within `sample`; multi-turn episodes: the tool loop `join`s them between turns).

Exactness. Each row reads exactly its own tokens: the columns it did not fill (left padding, another row's longer
chunk, steps after its turn ended, columns from before it joined) are masked out, and positions count its real tokens
only. A sliding window is counted in those positions: for a model with one, the engine builds the 4D masks itself
(`window_masks`) and keeps every column in plain `DynamicLayer`s, where transformers' own masks and sliding layers
count cache columns, which the masked ones would displace.

Random streams. Rows draw their tokens from a `Stream`: the default generator (every row of a batch together) or a
prompt's own (`generation.seed_per_prompt`, evaluation batches). A stream draws one (slots, V) sample per step over
the rows it had when the turn began, finished rows' slots included (`sample_slots`: a row's token depends only on its
probabilities and its slot), so dropping finished rows changes no other row's token, and the tokens are those of a
loop that kept every row in the batch until the last one ended.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
from dataclasses import dataclass, field

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.errors import UserError
from rlhfkit.generation.sampling import sample_slots
from rlhfkit.generation.stops import StopStrings

WINDOWED_LAYERS = ("full_attention", "sliding_attention")  # the layer types whose masks the engine can build


@dataclass(eq=False)
class Stream:
    """The random stream a set of rows draw from together: `generator` None is the device's default one."""

    generator: torch.Generator | None = None
    slots: int = 0  # rows of its draw in the current turn


@dataclass(eq=False)
class Row:
    """A row of the cache: the caller's `key` for it, its stream and slot there, the tokens it sampled that the cache
    has not seen (a turn's last token: the turn ends before feeding it)."""

    key: object
    stream: Stream
    slot: int = 0
    unfed: list[int] = field(default_factory=list)


@dataclass
class Parked:
    """Rows taken out of the cache while the others go on (their turn ended): their keys and values per layer, cache
    mask and next positions, as they were."""

    rows: list[Row]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    next_position: torch.Tensor


@dataclass
class Turn:
    """One row's turn as sampled: its tokens, their log-probs, and whether a stop string ended it (else EOS, the
    budget, or the turn is not over)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False

    def ended(self, eos: int) -> bool:
        """Whether the turn ended by itself (its EOS or a stop string), not cut by its budget."""
        return self.stopped or (bool(self.ids) and self.ids[-1] == eos)


@dataclass
class Group:
    """Rows waiting to join a session: `keys` rows of one `prompt`, drawing from `stream`."""

    keys: list
    prompt: list[int]
    stream: Stream
    budget: int  # tokens each row may sample in its turn


def cache_argument(model) -> str:
    """The name the model's forward gives its KV cache: `cache` from transformers 5.24, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def sliding_window_of(config) -> int | None:
    """The window of a model's sliding-window attention layers (Mistral's, Gemma 2/3's alternate layers, Qwen2's with
    `use_sliding_window`), or None when every layer attends to the whole sequence."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    return None if not window or (types is not None and "sliding_attention" not in types) else int(window)


def static_cache_length(width: int) -> int:
    """A static cache's length, rounded up to a multiple of 128 so that batches of nearby prompt widths share one
    compiled graph (each new length compiles again)."""
    return -(-width // 128) * 128


def compiled_step(model, forward, cuda: bool):
    """The one-token step compiled once per model and kept on it (policy and reference alternating in an evaluation
    keep their own graphs): CUDA graphs on a GPU, inductor's fused kernels on CPU."""
    step = model.__dict__.get("_rlhfkit_decode_step")
    if step is None:
        step = torch.compile(forward, mode="reduce-overhead" if cuda else None, dynamic=False)
        model.__dict__["_rlhfkit_decode_step"] = step  # a plain attribute: no submodule, no state-dict entry
    return step


def next_logits(model, arg: str, ids: torch.Tensor, attention, positions: torch.Tensor, cache) -> torch.Tensor:
    """One forward of (n, S) tokens through `cache` (passed as `arg`) -> the last position's logits (n, V), fp32;
    transformers computes the logits of that position only."""
    return model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1,
                 **{arg: cache}).logits[:, -1].float()


def window_masks(mask: torch.Tensor, positions: torch.Tensor, window: int, layer_types, dtype, eager: bool):
    """The attention masks of one forward, built from real-token positions: `mask` (n, W) marks each row's real
    columns (the S new ones last), `positions` (n, S) the new tokens' positions. A query attends to the real columns
    whose position is at most its own, on a sliding layer also less than `window` before it (transformers' rule,
    counted in positions, not columns); a padding query attends to itself only (a row of no key would give NaN).
    -> (n, 1, S, W) boolean (sdpa) or additive (eager), or {layer type: mask} for a model that mixes types."""
    n, width = mask.shape
    s = positions.shape[1]
    real = mask.bool()
    column = real.long().cumsum(1) - 1  # (n, W) each real column's position
    seen = real[:, None, :] & (column[:, None, :] <= positions[:, :, None])  # (n, S, W)
    own = torch.zeros(s, width, dtype=torch.bool, device=mask.device)
    own[torch.arange(s), torch.arange(width - s, width)] = True
    padding = ~real[:, -s:]  # (n, S) queries that are padding

    def finished(allowed):
        allowed = torch.where(padding[:, :, None], own, allowed)[:, None]  # (n, 1, S, W)
        if not eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)

    near = seen & (positions[:, :, None] - column[:, None, :] < window)
    if layer_types is None:  # every layer slides (Mistral)
        return finished(near)
    return {"full_attention": finished(seen), "sliding_attention": finished(near)}


def rebuilt_cache(rows: int, width: int, parts: list[list], places: list[tuple[torch.Tensor, int]]):
    """A new dynamic cache of `rows` rows and `width` columns from the `parts` (each a list of (keys, values) per
    layer, spent: an entry is dropped as it is copied). `places`: one per part, the rows (k,) its rows go to and the
    column its first column goes to (negative: that many of its first columns are cut off); the columns no part fills
    are zeros, which the session's mask hides.

    A tensor at a time, each old one released as its new one is filled, so rows that park and rejoin (`unpark`) or
    join (`join`) leave one cache plus one layer's keys live at the peak, the one cache the planner counts; a
    `DynamicCache(ddp_cache_data=...)` of stacked tensors copied every layer while the old cache and the parts lived.
    The caller holds no other reference to the parts' tensors (`Session` drops its old cache first)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    for i in range(len(parts[0])):
        new = []
        for slot in (0, 1):
            sources = [part[i][slot] for part in parts]
            for part in parts:
                part[i] = (None, part[i][1]) if slot == 0 else None
            out = sources[0].new_zeros(rows, sources[0].shape[1], width, sources[0].shape[-1])
            for source, (to, at) in zip(sources, places):
                source = source[..., max(0, -at):, :]
                out[to, :, max(0, at): max(0, at) + source.shape[-2]] = source
            del sources, source
            new.append(out)
        layer = DynamicLayer()
        layer.lazy_initialization(*new)
        layer.keys, layer.values = new
        cache.layers.append(layer)
    return cache


class Session:
    """One KV cache over a batch of rows, across their turns (module docstring).

    `mask` (n, W) marks the cache columns each row reads (1: one of its real tokens), `next_position` (n,) the position
    of each row's next real token, `logits` (n, V) each row's next-token logits after `start` / `extend`."""

    def __init__(self, model, params: GenerationConfig, eos_token_id: int, pad_token_id: int, device,
                 stop: StopStrings | None = None):
        self.model, self.params, self.eos, self.pad, self.device = model, params, eos_token_id, pad_token_id, device
        self.stop = stop
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.window = sliding_window_of(config)
        types = getattr(config, "layer_types", None)
        self.layer_types = types if self.window is not None else None
        if self.window is not None:
            check_windowed(model, config, types)
        self.eager = getattr(config, "_attn_implementation", None) == "eager"
        self.static, self.arg = params.compile, cache_argument(model)
        self.cache = self.mask = self.next_position = self.logits = None
        self.rows: list[Row] = []
        self.cache_len = 0

    # -- the model -----------------------------------------------------------------------------------------------

    def new_cache(self, width: int):
        from transformers import DynamicCache, StaticCache

        if self.static:
            self.cache_len = static_cache_length(width + self.params.max_new_tokens)
            return StaticCache(config=self.model.config, max_cache_len=self.cache_len)
        # A windowed model keeps every column in plain layers: the engine's masks carry the window.
        return DynamicCache() if self.window is not None else DynamicCache(config=self.model.config)

    def call(self, ids: torch.Tensor, attention, positions: torch.Tensor, cache) -> torch.Tensor:
        """The model's forward: (n, S) tokens -> the last position's logits (n, V), fp32."""
        return next_logits(self.model, self.arg, ids, attention, positions, cache)

    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Feeds (n, S) tokens, `real` (n, S) marking the rows' real ones; -> the last position's logits (n, V)."""
        real = real.long()
        positions = self.next_position[:, None] + real.cumsum(1) - real  # (n, S)
        self.mask = torch.cat([self.mask, real], 1) if self.mask is not None else real
        self.next_position = self.next_position + real.sum(1)
        if self.static:
            # The static cache's columns: those written so far, then ones that causality hides until written.
            attention = torch.nn.functional.pad(self.mask, (0, self.cache_len - self.mask.shape[1]), value=1)
            if ids.shape[1] == 1:
                # compiled over the model, not this session (the graph outlives it, and must not keep its cache)
                step = compiled_step(self.model, functools.partial(next_logits, self.model, self.arg), ids.is_cuda)
                if ids.is_cuda:
                    torch.compiler.cudagraph_mark_step_begin()  # the previous replay's output is no longer read
                return step(ids, attention, positions, self.cache).clone()
        elif self.window is not None:
            dtype = next(self.model.parameters()).dtype
            attention = window_masks(self.mask, positions, self.window, self.layer_types, dtype, self.eager)
        else:
            attention = self.mask
        return self.call(ids, attention, positions, self.cache)

    # -- rows ----------------------------------------------------------------------------------------------------

    def start(self, groups: list[Group]) -> None:
        """The groups' rows become the cache's, their prompts prefilled (left-padded), each distinct prompt once: a
        row's numbers do not depend on the rows beside it, so a copy holds what its own prefill would have written."""
        self.rows, self.cache, self.mask, self.next_position, self.logits = self.prefill(groups)

    def prefill(self, groups: list[Group]):
        """(rows, cache, mask, next positions, logits) of the groups' rows alone (`start`)."""
        prompts = [tuple(g.prompt) for g in groups for _ in g.keys]
        rows = [Row(key, g.stream) for g in groups for key in g.keys]
        distinct = list(dict.fromkeys(prompts)) if not self.static else prompts
        width = max(map(len, distinct))
        saved = self.cache, self.mask, self.next_position
        self.cache, self.mask = self.new_cache(width), None
        self.next_position = torch.zeros(len(distinct), dtype=torch.long, device=self.device)
        try:
            logits = self.forward(*self.left_padded([list(p) for p in distinct]))
            if len(distinct) < len(prompts):
                where = {p: i for i, p in enumerate(distinct)}
                index = torch.tensor([where[p] for p in prompts], device=self.device)
                self.keep(index)
                logits = logits[index]
            return rows, self.cache, self.mask, self.next_position, logits
        finally:
            self.cache, self.mask, self.next_position = saved

    def keep(self, index: torch.Tensor) -> None:
        """The cache's rows `index` (k,) become its rows: a subset, or rows copied."""
        self.cache.batch_select_indices(index)
        self.mask, self.next_position = self.mask[index], self.next_position[index]

    def select(self, rows: list[int]) -> None:
        """Keeps the session's `rows` (indices) only, in that order."""
        if rows != list(range(len(self.rows))):
            self.keep(torch.tensor(rows, dtype=torch.long, device=self.device))
            self.rows = [self.rows[r] for r in rows]
            self.logits = self.logits[rows] if self.logits is not None else None

    @property
    def rebuildable(self) -> bool:
        """Whether the cache can be rebuilt from its keys and values (rows parked, rows joining): a dynamic cache of
        attention layers only (a model's linear-attention or shared layers hold other state)."""
        return not self.static and not any(self.cache.is_linear) and not any(getattr(self.cache, "is_dummy", []))

    def park(self, rows: list[int]) -> Parked:
        """Takes the session's `rows` (indices) out of the cache, kept aside until `unpark`."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        parked = Parked([self.rows[i] for i in rows], [(k[index], v[index]) for k, v, *_ in self.cache],
                        self.mask[index], self.next_position[index])
        self.select([i for i in range(len(self.rows)) if i not in set(rows)])
        return parked

    def unpark(self, parked: list[Parked], order: list[Row]) -> None:
        """The parked rows back into the cache, the rows then in `order`: their columns padded on the right with
        masked ones to the width the others reached (both share the columns from before the parking). The cache is
        rebuilt a tensor at a time, each old one (the session's and the parked ones) released as its new one
        is filled (`rebuilt_cache`): one cache plus one layer live at the peak, as the planner counts; `parked` is
        spent."""
        width = self.mask.shape[1]
        parts = [Parked(self.rows, [], self.mask, self.next_position), *parked]
        where = {id(row): i for i, row in enumerate(row for part in parts for row in part.rows)}
        index = torch.tensor([where[id(row)] for row in order], dtype=torch.long, device=self.device)
        goes = torch.empty_like(index)
        goes[index] = torch.arange(len(order), device=self.device)  # each part's rows' places in `order`
        bounds = [0, *itertools.accumulate(len(p.rows) for p in parts)]
        places = [(goes[a:b], 0) for a, b in zip(bounds, bounds[1:])]
        own, self.cache = [(k, v) for k, v, *_ in self.cache], None
        self.cache = rebuilt_cache(len(order), width, [own, *(p.kv for p in parked)], places)
        self.mask = torch.cat([torch.nn.functional.pad(p.mask, (0, width - p.mask.shape[1])) for p in parts])[index]
        self.next_position = torch.cat([p.next_position for p in parts])[index]
        self.rows, self.logits = list(order), None  # the next logits come from `extend`

    def join(self, groups: list[Group]) -> None:
        """The groups' rows join the cache after its rows (continuous refill): prefilled on their own, then both
        caches left-padded with masked columns to one width and stacked, columns no row reads cut off the left."""
        if not self.rebuildable:
            raise UserError("generation.max_batch_rows: continuous refill needs the dynamic KV cache (generation.compile "
                            "false) and a model whose every layer is attention")
        rows, cache, mask, positions, logits = self.prefill(groups)
        self.give_slots(rows)
        old, widths = self.mask.shape[0], (self.mask.shape[1], mask.shape[1])
        width = max(widths)
        mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in (self.mask, mask)])
        first = int(mask.any(0).long().argmax())  # columns before this one hold no row's token
        places = [(torch.arange(a, b, device=self.device), width - w - first)
                  for a, b, w in ((0, old, widths[0]), (old, mask.shape[0], widths[1]))]
        joining = [(layer.keys, layer.values) for layer in cache.layers]
        own, self.cache, cache = [(k, v) for k, v, *_ in self.cache], None, None
        self.cache = rebuilt_cache(mask.shape[0], width - first, [own, joining], places)
        self.mask, self.next_position = mask[:, first:], torch.cat([self.next_position, positions])
        self.logits = torch.cat([self.logits[: len(self.rows) - len(rows)], logits])

    def extend(self, rows: list[int], chunks: list[list[int]]) -> None:
        """Keeps the session's `rows` only and feeds each its unfed token and then its chunk (the tokens appended
        after its turn: tool results, the next header)."""
        self.select(rows)
        chunks = [row.unfed + chunk for row, chunk in zip(self.rows, chunks)]
        for row in self.rows:
            row.unfed = []
        self.logits = self.forward(*self.left_padded(chunks))

    def left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[self.pad] * (width - len(s)) + s for s in seqs], device=self.device)
        real = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        return ids, real

    # -- sampling ------------------------------------------------------------------------------------------------

    def draw(self, logits: torch.Tensor, live: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from the rows' streams: each stream with a live row draws over all its slots, those of
        rows no longer in the cache drawn as if their logits were flat (module docstring; `sample_slots`).
        -> tokens (n,), log-probs (n,)."""
        streams = list(dict.fromkeys(row.stream for row, on in zip(self.rows, live) if on))
        if len(streams) == 1 and all(row.stream is streams[0] for row in self.rows):  # one stream, every row its own
            return sample_slots(logits, [row.slot for row in self.rows], streams[0].slots, self.params,
                                streams[0].generator)
        tokens = torch.full((len(self.rows),), self.pad, dtype=torch.long, device=logits.device)
        logprobs = torch.zeros(len(self.rows), dtype=torch.float32, device=logits.device)
        for stream in streams:
            mine = [i for i, row in enumerate(self.rows) if row.stream is stream]
            index = torch.tensor(mine, device=logits.device)
            token, logprob = sample_slots(logits[index], [self.rows[i].slot for i in mine], stream.slots, self.params,
                                          stream.generator)
            tokens[index], logprobs[index] = token, logprob
        return tokens, logprobs

    def lay_out_streams(self, rows: list[Row]) -> None:
        """Each stream's slots for a turn: its rows in order (`draw`)."""
        counts = collections.Counter()
        for row in rows:
            row.slot = counts[row.stream]
            counts[row.stream] += 1
        for stream, n in counts.items():
            stream.slots = n

    def admit(self, waiting: collections.deque, max_rows: int) -> list[Group]:
        """The waiting groups that fit beside the cache's rows (`max_rows` in all), in order."""
        room, admitted = max_rows - len(self.rows), []
        while waiting and len(waiting[0].keys) <= room:
            room -= len(waiting[0].keys)
            admitted.append(waiting.popleft())
        return admitted

    def give_slots(self, rows: list[Row]) -> None:
        """Slots for rows joining a turn: a stream's free ones, lowest first, new ones past its last when too few are
        free (a prompt's own stream has none yet: its rows take 0..k-1)."""
        for row in rows:
            used = {r.slot for r in self.rows if r.stream is row.stream and r is not row}
            free = [s for s in range(row.stream.slots) if s not in used]
            if not free:
                free, row.stream.slots = [row.stream.slots], row.stream.slots + 1
            row.slot = free[0]
            self.rows.append(row)

    def sample(self, budgets: list[int], keep_finished: bool = False, waiting: collections.deque | None = None,
               max_rows: int = 0) -> dict:
        """Samples one turn per row, until its EOS, a stop string or its budget (`budgets`: one per row; a waiting
        group's rows get theirs); -> {row key: its `Turn`}.

        `keep_finished` (a multi-turn caller, which may extend a row after its turn): a row whose turn ended is parked
        out of the cache while the others go on (`park`; where the cache cannot be rebuilt, it stays, fed masked
        padding), and back in its place when the turn is over, its last token left unfed. Else it leaves the cache at
        once, and `waiting` groups join when there is room for them (`max_rows` rows in all: continuous refill)."""
        self.lay_out_streams(self.rows)
        budget = {row.key: b for row, b in zip(self.rows, budgets)}
        turns = {row.key: Turn() for row in self.rows}
        live = [budget[row.key] > 0 for row in self.rows]
        order, parked = list(self.rows), []
        parking = keep_finished and self.rebuildable and any(live)
        for row, on in zip(self.rows, live):
            row.unfed = [] if keep_finished and not on else row.unfed
        if parking and not all(live):
            parked.append(self.park([i for i, on in enumerate(live) if not on]))
            live = [True] * len(self.rows)
        while any(live):
            token, logprob = self.draw(self.logits, live)
            fed = list(live)
            tokens = self.record(token, logprob, live, turns, budget)
            if keep_finished and not any(live):
                for i, row in enumerate(self.rows):
                    row.unfed = [tokens[i]] if fed[i] else []
                break
            if parking and not all(live):
                for i, row in enumerate(self.rows):
                    row.unfed = [tokens[i]] if not live[i] else []
                parked.append(self.park([i for i, on in enumerate(live) if not on]))
                token, live = token[[i for i, on in enumerate(fed) if on and live[i]]], [True] * len(self.rows)
                fed = live
            if keep_finished or self.static:
                real = torch.tensor(fed if not self.static else [True] * len(fed), device=self.device)
                self.logits = self.step(token.masked_fill(~real, self.pad), real)
                continue
            kept = [i for i, on in enumerate(live) if on]
            self.select(kept)
            if kept:
                self.logits = self.step(token[kept], torch.ones(len(kept), dtype=torch.bool, device=self.device))
            joining = self.admit(waiting, max_rows) if waiting else []
            for group in joining:
                budget.update((key, group.budget) for key in group.keys)
                turns.update((key, Turn()) for key in group.keys)
            if joining:
                self.join(joining)
            live = [True] * len(self.rows)
        if parked:
            self.unpark(parked, order)
        return turns

    def record(self, token: torch.Tensor, logprob: torch.Tensor, live: list[bool], turns: dict, budget: dict) -> list[int]:
        """Appends each live row's drawn token and log-prob to its turn; a row stays live (`live`, updated) unless the
        token is its EOS, completes a stop string (`stops`) or spends its budget. -> the drawn tokens."""
        tokens, values, fed = token.tolist(), logprob.tolist(), list(live)
        for i, row in enumerate(self.rows):
            if fed[i]:
                turn = turns[row.key]
                turn.ids.append(tokens[i])
                turn.logprobs.append(values[i])
                live[i] = tokens[i] != self.eos and len(turn.ids) < budget[row.key]
        if self.stop is not None:
            check = [i for i, on in enumerate(fed) if on and tokens[i] != self.eos]
            for i, hit in zip(check, self.stop.ended([turns[self.rows[i].key].ids for i in check])):
                if hit:
                    live[i], turns[self.rows[i].key].stopped = False, True
        return tokens

    def step(self, token: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Feeds one token per row (`real`: which are real) -> the next logits (n, V)."""
        return self.forward(token[:, None], real[:, None])


def check_windowed(model, config, layer_types) -> None:
    """A one-line UserError for a sliding-window model the engine cannot mask exactly: its masks are 4D tensors, which
    sdpa and eager attention read (flash and flex attention take the window from the layer, counted in columns), over
    full and sliding attention layers only."""
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if "flash" in implementation or "flex" in implementation:
        raise UserError(f"generation: {config.model_type}'s sliding-window attention is sampled with masks built from "
                        f"each row's token positions, which {implementation} does not take; load the model with "
                        "sdpa or eager attention")
    other = sorted(set(layer_types or ()) - set(WINDOWED_LAYERS))
    if other:
        raise UserError(f"generation: {config.model_type} has {other[0]} layers beside its sliding-window ones; the "
                        "engine masks full and sliding attention layers only")
