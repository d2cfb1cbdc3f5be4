"""The config sections every stage shares (model, data, optim, logging, generation, reward, KL) and `TrainConfig`,
the keys of every training stage. Each field is declared once, here, with its type, its range and its documentation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from annotated_types import Ge, Interval, Len, doc

from rlhfkit.config.fields import Fraction, NonNeg, NonNegInt, PosInt, Positive, Seed


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False  # train LoRA adapters (peft) instead of the full model
    r: PosInt = 16  # adapter rank
    alpha: PosInt = 32  # scaling numerator: the update is scaled by alpha / r
    dropout: Fraction = 0.05  # dropout on the adapter input
    target_modules: str | list[str] = "all-linear"  # peft target modules; "all-linear" = every linear but the head
    merge_on_save: bool = True  # save merged full weights (loadable without peft); False saves the adapter only


@dataclass(frozen=True)
class QuantizationConfig:
    """QLoRA (Dettmers et al. 2023, arXiv 2305.14314): the frozen base held in 4 bits by bitsandbytes (the optional
    extra: `pip install 'rlhfkit[qlora]'`), each block dequantized to `bnb_4bit_compute_dtype` for its matmul; a
    trained model trains LoRA adapters on it. The names are those of transformers' `BitsAndBytesConfig`; the
    defaults are the paper's (NF4, double quantization), not transformers' (FP4, single). One process or DDP."""

    load_in_4bit: bool = False  # linear layers in 4 bits; embeddings, norms and the LM/score head stay in model.dtype
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"  # NormalFloat4 (the paper's data type) or plain FP4
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # matmul dtype; the paper's is bfloat16
    bnb_4bit_use_double_quant: bool = True  # quantize the per-block scales too (about 0.4 bit per weight saved)

    def check(self):
        if self.load_in_4bit and (problem := bitsandbytes_problem()):
            yield "load_in_4bit", problem


def bitsandbytes_problem() -> str | None:
    """Why 4-bit loading cannot run on this machine, or None."""
    try:
        import bitsandbytes
    except ImportError:
        return "needs bitsandbytes, which is not installed: pip install 'rlhfkit[qlora]'"
    import torch
    from packaging.version import Version

    if Version(bitsandbytes.__version__) < Version("0.46.1"):  # transformers' minimum, the first with a CPU backend
        return f"needs bitsandbytes >= 0.46.1, found {bitsandbytes.__version__}: pip install -U 'rlhfkit[qlora]'"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in bitsandbytes.supported_torch_devices:
        return (f"is not supported on this machine: bitsandbytes {bitsandbytes.__version__} runs 4-bit layers on "
                f"{', '.join(sorted(bitsandbytes.supported_torch_devices))}, not {device}")
    if any(os.environ.get(f"ACCELERATE_USE_{k}", "").lower() in ("1", "true") for k in ("FSDP", "DEEPSPEED")):
        return "works with one process or DDP, not FSDP or DeepSpeed (they shard 4-bit weights only when told how)"
    return None


@dataclass(frozen=True)
class ModelConfig:
    # A local directory, a hub name (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"), a directory or hub repo holding
    # `gguf_file`, or "tiny" for a tiny random model and tokenizer built offline (tests and *_tiny.yaml configs).
    name_or_path: str = ""
    gguf_file: str | None = None  # a .gguf file inside name_or_path (or a path); converted once to safetensors
    revision: str | None = None  # hub revision (branch, tag or commit)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"  # weights dtype on load
    gradient_checkpointing: bool = False  # trade compute for activation memory
    trust_remote_code: bool = False  # run model code from the hub; off unless you trust the repo
    # The tokenizer's chat template, replaced (None: its own): a bundled name ("chatml_tools": ChatML that renders
    # tools, tool calls and tool turns; "smollm2_tools": the same with SmolLM2's default system turn), a .jinja file
    # (with its response template, for parsing tool calls, in a sibling <stem>.response.json), or a tokenizer's
    # directory. Saved with the model. Data with tools needs a template that renders them.
    chat_template: str | None = None
    # Keep only the first N transformer layers (None = all): a smaller, faster model from the bottom of a larger
    # one, e.g. a reward or value model initialised from the SFT model at a fraction of its cost.
    num_layers: PosInt | None = None
    # transformers' attention kernel (None: its default, sdpa where the model supports it); flash_attention_2 needs
    # the flash-attn package and a CUDA GPU, and is refused before any model loads where it cannot run.
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)  # QLoRA: a 4-bit base

    def check(self):
        if not self.name_or_path:
            yield "name_or_path", "is required (a local directory, a hub name, or 'tiny')"


# The fields a record of any stage can have (rlhfkit.data's formats): what data.columns may map a column to.
RECORD_FIELDS = ("prompt", "completion", "chosen", "rejected", "label", "margin", "messages", "text", "tools")


@dataclass(frozen=True)
class DataConfig:
    """Training stages read `train` (required there) and `eval`; `rlhfkit eval` reads its held-out prompts from
    `eval` (required there) with `eval_split`, `max_prompt_length`, `max_length` and `truncation`."""

    KEY_HINTS = {"split": "a hub dataset's splits are data.train_split (default 'train') and data.eval_split "
                          "(default 'test')"}  # a class attribute, not a field

    train: str = ""  # a local .jsonl/.json/.csv/.parquet file or a hub dataset name
    eval: str | None = None  # same forms as `train`; None = hold out `eval_fraction` of train (or no eval)
    train_split: str = "train"  # split used when `train` is a hub dataset
    eval_split: str = "test"  # split used when `eval` is a hub dataset
    eval_fraction: Fraction = 0.0  # with no `eval`: this fraction of train is held out (seeded) for evaluation
    # Tokens in prompt + response (eval: of a `preference_data` pair); longer responses are cut (counted, reported).
    max_length: Annotated[int, Ge(2)] = 1024
    max_prompt_length: int = 512  # tokens in the prompt; see `truncation`
    truncation: Literal["truncate", "error"] = "truncate"  # over-long prompt: keep its last tokens, or fail
    packing: bool = False  # SFT only: concatenate examples into full `max_length` rows (no padding waste)
    # SFT, RM, DPO/IPO/cDPO/SimPO and ORPO: each micro-batch's sequences end to end in one row, position ids restarting
    # at 0 per sequence and no attention mask, so no pad token is computed and no token attends across sequences (unlike
    # `packing`); loss, gradients, log-probs and rewards equal the padded batch's (the RM reads each sequence's score
    # at its last token). Attention runs per sequence (flash attention, or sdpa split by sequence); eager, sliding-window
    # or softcapped attention runs one masked (N, N) product over the row, which can cost more than the padding saved.
    padding_free: bool = False
    max_samples: PosInt | None = None  # use only the first N records of each split (quick experiments)
    subset: str | None = None  # the configuration (subset) of the hub datasets `train` and `eval` name
    # Record fields read from other columns, field -> column (e.g. {prompt: question}): TRL's column renaming.
    columns: dict[str, str] = field(default_factory=dict)
    # Online stages and rft: held-out reference texts in any SFT format (a file or hub dataset) on which each
    # evaluation measures the alignment tax, the policy's and the reference's mean per-token NLL of their responses
    # (`rlhfkit eval`'s `capability_data`); the `alignment_tax` alarm reads their difference.
    capability: str | None = None
    # Online stages: SFT records (any format the sft stage takes; `columns` and `subset` do not apply to them) whose
    # next-token loss is mixed into every update with weight algo.ptx_coef (PPO-ptx, InstructGPT arXiv 2203.02155 eq. 2).
    ptx: str | None = None

    def check(self):
        for name in self.columns:
            if name not in RECORD_FIELDS:
                yield f"columns.{name}", ("is not a record field: give data.columns.<field>=<column>, field one of "
                                          + ", ".join(RECORD_FIELDS))
        for column in sorted(set(self.columns.values())):
            if len(names := sorted(k for k, v in self.columns.items() if v == column)) > 1:
                yield "columns", f"renames column '{column}' twice (to {' and '.join(names)})"
        if not 1 <= self.max_prompt_length < self.max_length:
            yield "max_prompt_length", f"must be in [1, max_length={self.max_length}), got {self.max_prompt_length}"
        if self.padding_free and self.packing:
            yield "padding_free", "and data.packing are exclusive: packing lets attention cross example boundaries"


@dataclass(frozen=True)
class OptimConfig:
    lr: NonNeg = 1e-5  # peak learning rate (AdamW)
    weight_decay: NonNeg = 0.0  # AdamW's decoupled weight decay
    adam_betas: Annotated[list[Fraction], Len(2, 2)] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (β1, β2)
    adam_eps: Positive = 1e-8  # AdamW's ε, added to the denominator
    scheduler: Literal["constant", "linear", "cosine"] = "linear"  # decay after warmup
    warmup_steps: NonNegInt = 0  # linear warmup steps; overrides warmup_ratio when > 0
    warmup_ratio: Fraction = 0.0  # warmup as a fraction of the total optimizer steps
    max_grad_norm: Positive | None = 1.0  # clip the global gradient norm; None = no clipping
    per_device_batch_size: PosInt = 8  # examples (pairs, for preference data) per micro-batch per process
    grad_accum_steps: PosInt = 1  # micro-batches per optimizer step


@dataclass(frozen=True)
class LoggingConfig:
    logging_steps: PosInt = 10  # write metrics every N optimizer steps
    eval_steps: NonNegInt = 0  # evaluate every N steps (0 = only at the end of training)
    save_steps: NonNegInt = 0  # write a resumable checkpoint every N steps (0 = none before the final save)
    save_total_limit: PosInt = 2  # keep the N newest checkpoints
    # Trackers beside metrics.jsonl, each an optional extra (`pip install 'rlhfkit[wandb]'`): every logged metric,
    # the sampled completions (online stages, rft) as a table or text, the resolved config as the run's config.
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = field(default_factory=list)
    progress_bar: bool = True  # tqdm bar with the live loss
    # Online stages (ppo, rloo, grpo, reinforce_pp, online_dpo): write sample generations to samples.jsonl and the
    # trackers' tables every N steps, besides the first and the last.
    sample_log_steps: PosInt = 10
    # Online stages: print the console table (Step | Reward | KL | ClipFrac | ValueLoss | PolicyLoss | LR) every N steps.
    table_steps: PosInt = 10
    run_name: str | None = None  # the run's name in TensorBoard, W&B and trackio (default: output_dir's name)
    # The W&B and trackio project the run goes in; None: W&B's own choice (WANDB_PROJECT, else its default), and
    # "rlhfkit" for trackio.
    project: str | None = None
    push_to_hub: bool = False  # upload the final model (with its model card) to the hub repo `hub_model_id`
    hub_model_id: str | None = None  # the model repo to push to, "user/name" (created if absent)
    # Which checkpoints are pushed too, under transformers' names: "end" none, "checkpoint" the latest in
    # last-checkpoint/, "all_checkpoints" each in its own checkpoint-N/.
    hub_strategy: Literal["end", "checkpoint", "all_checkpoints"] = "end"
    # The evaluation figure callbacks follow (`args.metric_for_best_model`, `state.best_metric`: transformers'
    # EarlyStoppingCallback), by its logged name with or without eval/ (e.g. objective/scores, eval/objective/gold);
    # None: eval_loss on sft, rm, dpo, orpo and kto with an eval set, none elsewhere.
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None  # None: true unless the metric's name ends with "loss" (transformers' rule)

    def check(self):
        if self.push_to_hub and not self.hub_model_id:
            yield "hub_model_id", "is required with logging.push_to_hub=true (the repo to push to, 'user/name')"


@dataclass(frozen=True)
class GenerationConfig:
    """How responses are sampled; `generation.generate` takes this section as its sampling parameters."""

    max_new_tokens: PosInt = 64  # response length cap; a response cut here has no EOS (see reward.missing_eos_penalty)
    temperature: Positive = 1.0  # applied identically to sampling and to old, new and reference log-probs
    top_k: Annotated[int, Ge(0), doc("0 = off")] = 0  # sample among the k most likely tokens only
    top_p: Annotated[float, Interval(gt=0, le=1), doc("1.0 = off")] = 1.0  # nucleus: the most likely tokens up to this total probability
    num_samples: PosInt = 1  # responses per prompt: the group size k of RLOO/GRPO (>= 2 there)
    # "rlhfkit": our decode loop over transformers' KV cache (samples the trained density only; the model's own
    # generation_config plays no part); "hf": transformers' `generate`, the reference it is tested against.
    engine: Literal["rlhfkit", "hf"] = "rlhfkit"
    # With engine "rlhfkit": a static KV cache and a compiled one-token step (on a GPU, CUDA graphs through
    # torch.compile mode "reduce-overhead"); each new batch shape compiles once, so it pays off over many steps.
    compile: bool = False
    # Online stages: each prompt's responses drawn alone under a seed of (seed, step, the prompt's tokens), so a run
    # draws the same responses whatever its number of processes or batch layout (N processes ≡ 1); one prompt at a
    # time, so slower. False: one random stream per process, the whole batch at once.
    seed_per_prompt: bool = False
    # Rows the engine samples at once (prompts x num_samples). With more waiting, a prompt's rows join as soon as
    # finished rows leave room (continuous refill); with tools, a prompt's episodes join at the end of a round of
    # turns that left room for them. null: every row of a call at once.
    max_batch_rows: PosInt | None = None
    # A row ends at the first token at which one of these occurs in its turn's text (`tokenizer.decode` of the turn's
    # tokens, special tokens included; a string may span tokens): that token is the last kept, as EOS is, and the row
    # counts as ended, not cut. transformers' / TRL's `stop_strings` (docs/stages/online-rl.md, "Stop strings").
    stop_strings: list[str] = field(default_factory=list)

    def check(self):
        if self.compile and self.engine != "rlhfkit":
            yield "compile", "compiles rlhfkit's decode loop: needs generation.engine=rlhfkit"
        if self.stop_strings and self.engine != "rlhfkit":
            yield "stop_strings", "stop strings end rows in rlhfkit's decode loop: needs generation.engine=rlhfkit"
        if "" in self.stop_strings:
            yield "stop_strings", "an empty string would end every row at its first token"
        if self.max_batch_rows is not None:
            if self.engine != "rlhfkit" or self.compile:
                yield "max_batch_rows", ("continuous refill is rlhfkit's dynamic-cache engine: needs "
                                         "generation.engine=rlhfkit and generation.compile=false")
            elif self.max_batch_rows < self.num_samples:
                yield "max_batch_rows", (f"must hold one prompt's samples (generation.num_samples={self.num_samples}), "
                                         f"got {self.max_batch_rows}")


@dataclass(frozen=True)
class ToolsConfig:
    """Multi-turn episodes with tools (`rollout.tool_loop`, TRL's `tools` and `environment_factory`): the policy calls
    the registered functions, and the methods of an environment made for each episode, between its turns. Empty (no
    functions, no environment): single-turn sampling. The Python API's `tools=` / `environment_factory=` fill the first
    two keys. Needs a chat template that renders tools and a response template that parses calls
    (model.chat_template: chatml_tools)."""

    KEY_HINTS = {"max_tool_calling_iterations": "TRL's max_tool_calling_iterations is tools.max_calls"}
    functions: list[str] = field(default_factory=list)  # tools, "module:function" each (type hints + Google-style docstring)
    # environment_factory: "module:Class" (one instance per episode, `reset(**row)` before it, its public methods as
    # tools, an optional `get_reward()` as a reward source), or {name: "module:Class"} chosen by each row's
    # `environment` column.
    environment: str | dict[str, str] | None = None
    # Rounds of tool calls per episode (TRL's max_tool_calling_iterations); null: no limit but the length limit
    # (generation.max_new_tokens bounds the whole completion, tool results included).
    max_calls: PosInt | None = None
    timeout_s: Positive = 60.0  # a call running longer is abandoned: an {"error": ...} result and a counted failure
    max_result_tokens: PosInt = 1024  # a tool result longer than this (policy tokens) is cut there and marked

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.environment)

    @property
    def references(self) -> list[tuple[str, str]]:
        """(config key, "module:name") of every function and environment named."""
        refs = [(f"functions[{i}]", ref) for i, ref in enumerate(self.functions)]
        envs = self.environment if isinstance(self.environment, dict) else {None: self.environment} if self.environment else {}
        return refs + [("environment" if name is None else f"environment.{name}", ref) for name, ref in envs.items()]

    def check(self):
        for key, ref in self.references:
            if ":" not in ref:
                yield key, f"must be 'module:name', got {ref!r}"
        if isinstance(self.environment, dict) and not self.environment:
            yield "environment", "is an empty mapping: give {name: 'module:Class'} or one 'module:Class'"
        if not self.enabled:
            for key, default in (("max_calls", None), ("timeout_s", 60.0), ("max_result_tokens", 1024)):
                if getattr(self, key) != default:
                    yield key, "applies only with tools (tools.functions or tools.environment)"


@dataclass(frozen=True)
class AgentEvalConfig:
    """The agent figures of an evaluation with tools (`evaluation.agent`, docs/agents.md "Evaluating agents"): format
    accuracy (the share of assistant turns that ended and whose tool calls all parse and fit a tool, and that
    `format_check` accepts) and task completion (the share of episodes whose `task_judge` score reaches
    `task_threshold`). Applies only with tools (tools.functions or tools.environment)."""

    # Your own format rule, "module:function": fn(message) -> bool, called once per assistant turn with the turn as
    # parsed ({"role": "assistant", "content", "tool_calls"?}); False takes the turn out of the format.
    format_check: str | None = None
    # The judge whose score decides task completion: in `rlhfkit eval`, a judge's name (a reward function's name, a
    # `judges` entry's name, or reward_model); in training, a reward source's name (as in rewards/<name>/mean) or gold
    # (reward.gold_function). Null: no task completion.
    task_judge: str | None = None
    task_threshold: float = 1.0  # an episode completes its task when the judge's score is >= this (1.0: an exact-answer judge's full marks)

    def check(self):
        if self.format_check is not None and ":" not in self.format_check:
            yield "format_check", f"must be 'module:function', got {self.format_check!r}"
        if self.task_judge is None and self.task_threshold != 1.0:
            yield "task_threshold", "applies only with agent.task_judge (the judge whose score it thresholds)"

    def refusals(self, tools_enabled: bool):
        """(key, message) of each key set without tools, where no episode has turns or calls to measure."""
        if tools_enabled:
            return
        for key, default in (("format_check", None), ("task_judge", None), ("task_threshold", 1.0)):
            if getattr(self, key) != default:
                yield f"agent.{key}", "applies only with tools (tools.functions or tools.environment): the agent figures read tool episodes"


@dataclass(frozen=True)
class RewardConfig:
    """The reward sources and their weights (TRL's `reward_funcs` and `reward_weights`): first the reward models of
    `model` (each a source named after its directory; with `ensemble` mean|min and several models, one source named
    `ensemble_<mean|min>`), then the functions of `function` (each named after the function). A row's reward is
    Σ weight · score over the sources that scored it (a function returns None for a row it does not apply to), and each
    source is logged as rewards/<name>/mean and rewards/<name>/std. `rlhfkit eval` makes each reward model a judge
    ("reward_model" when alone, else "reward_model/<directory name>", plus "reward_model/ensemble_<mean|min>" for
    several) and each function one named after the function; it reports raw scores (the last five fields are unused)."""

    model: list[str] = field(default_factory=list)  # reward-model directories; one with its own tokenizer scores re-tokenised text
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)  # the reward models in 4 bits (frozen)
    ensemble: Literal["mean", "min", "none"] = "mean"  # several reward models as one source (mean; min is conservative), or none: each its own
    function: str | list[str] | None = None  # "module:function" or a list of them, called under TRL's contract (rlhfkit.reward_functions)
    weights: list[float] | None = None  # one per source, in the order above; null = 1 each
    gold_function: str | None = None  # optional "module:function" gold judge: logged as objective/gold, never trained on
    missing_eos_penalty: Annotated[float, Ge(0), doc("subtracted, as in TRL, from the score of a response cut at "
                                                     "max_new_tokens: e.g. 1.0 penalises truncation")] | None = None
    normalize: Literal["none", "batch", "running", "minmax"] = "none"  # z-score per batch / running, or min-max
    clip: Positive | None = None  # clip scores to [-clip, clip] after normalisation

    @property
    def functions(self) -> list[str]:
        return [self.function] if isinstance(self.function, str) else list(self.function or [])

    @property
    def num_sources(self) -> int:
        return (1 if len(self.model) > 1 and self.ensemble != "none" else len(self.model)) + len(self.functions)

    def check(self):
        refs = [("gold_function", self.gold_function)] if self.gold_function else []
        refs += [("function" if isinstance(self.function, str) else f"function[{i}]", f) for i, f in enumerate(self.functions)]
        for name, ref in refs:
            if ":" not in ref:
                yield name, f"must be 'module:function', got {ref!r}"
        if self.weights is not None and len(self.weights) != self.num_sources:
            yield "weights", (f"must give one weight per reward source ({self.num_sources}: the reward models, or their "
                              f"ensemble, then the functions), got {len(self.weights)}")

    def check_has_source(self):
        if not self.model and not self.functions:
            yield "reward.model", ("give at least one reward source: reward.model (reward-model directories) and/or "
                                   "reward.function (module:function, or a list)")


@dataclass(frozen=True)
class PlanConfig:
    """Every training run checks itself against its plan (`rlhfkit plan`, docs/memory.md): it prints the planned peak
    at its start and saves the plan as `plan.json` in output_dir; at its end it logs the measured peak beside the
    planned one (`memory/planned_peak_gb`, `memory/peak_gb`; on a CPU also `memory/peak_rss_gb`)."""

    # On a GPU, stop before any model loads when the planned peak exceeds the free memory by more than `margin`, with
    # the plan's first suggestion; false runs anyway.
    check: bool = True
    margin: Fraction = 0.1  # the excess over the free memory `check` tolerates, as a fraction of it
    # On a CPU, track the peak of live tensor storage op by op (a TorchDispatchMode: a Python call per op, which slows
    # a small model's steps; docs/memory.md gives the measured cost); false logs the peak resident memory only. A GPU
    # run always logs torch.cuda.max_memory_allocated.
    measure: bool = False


@dataclass(frozen=True)
class TrainConfig:
    """Keys every training stage shares."""

    KEY_HINTS = {"tools": "tools apply to the online stages that sample episodes (ppo, rloo, grpo, reinforce_pp, "
                          "online_dpo); to train on tool conversations, give the data a tools column"}
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = ""  # where the model, config.yaml, metrics.jsonl and checkpoints go
    seed: Seed = 42  # seeds data order, initialisation of new heads, dropout and sampling
    max_steps: int = -1  # optimizer steps; -1 = run `num_epochs` over the training set
    num_epochs: Positive = 1.0  # passes over the training set when max_steps is -1
    # Autocast through accelerate. "auto": bf16 on an accelerator that computes in bf16 natively, none on a CPU (the
    # start line says which); frozen models (reference, reward models) load in the chosen precision.
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    resume: bool = False  # continue from the newest checkpoint in output_dir
    overwrite: bool = False  # allow writing into an output_dir that holds another run
    # A non-finite loss or gradient (online RL: also reward or log-prob) skips the update and is counted
    # (`faults/skipped_total`); this many stop the run with exit status 2, its checkpoints intact.
    max_bad_steps: PosInt = 3
    plan: PlanConfig = field(default_factory=PlanConfig)  # the run's check against its plan (`rlhfkit plan`)
    padding_free_supported: ClassVar[bool] = False  # the stage's trainer has a padding-free path (data.padding_free)
    packing_supported: ClassVar[bool] = False  # the stage's trainer packs examples (data.packing)
    samples_supported: ClassVar[bool] = False  # the stage samples responses: held-out sampling eval, data.capability
    ptx_supported: ClassVar[bool] = False  # the stage mixes an SFT loss into its updates (data.ptx, algo.ptx_coef)
    online_log: ClassVar[bool] = False  # the stage logs online steps (logging.sample_log_steps, logging.table_steps)

    def check(self):
        if self.data.padding_free and not self.padding_free_supported:
            yield "data.padding_free", "is supported by the sft, rm, dpo and orpo stages only"
        if self.data.packing and not self.packing_supported:
            yield "data.packing", "is supported by the sft stage only (for the others, data.padding_free saves the padding)"
        if self.data.ptx is not None and not self.ptx_supported:
            yield "data.ptx", "is read by the online stages only (ppo, rloo, grpo, reinforce_pp, online_dpo)"
        if not self.data.train:
            yield "data.train", "is required (a local file or a hub dataset name)"
        for key in ("sample_log_steps", "table_steps"):
            if getattr(self.logging, key) != 10 and not self.online_log:
                yield f"logging.{key}", "is read by the online stages only (ppo, rloo, grpo, reinforce_pp, online_dpo)"
        if self.data.capability and not self.samples_supported:
            yield "data.capability", "is read by the sampling stages only (ppo, rloo, grpo, reinforce_pp, rft)"
        if self.samples_supported and self.logging.eval_steps and not (
                self.data.eval or self.data.eval_fraction or self.data.capability):
            yield "logging.eval_steps", ("has nothing to evaluate: give held-out prompts (data.eval or "
                                         "data.eval_fraction) and/or reference texts (data.capability)")
        evaluates = self.data.eval or self.data.eval_fraction or (self.samples_supported and self.data.capability)
        if self.logging.metric_for_best_model and not (evaluates and self.logging.eval_steps):
            yield "logging.metric_for_best_model", ("needs evaluations during training: an eval set (data.eval or "
                                                    "data.eval_fraction) and logging.eval_steps > 0")
        if not self.output_dir:
            yield "output_dir", "is required"
        if self.max_steps == 0 or self.max_steps < -1:
            yield "max_steps", f"must be >= 1 or -1 (use num_epochs), got {self.max_steps}"
        if self.resume and self.overwrite:
            yield "resume", "and overwrite=true are contradictory: resume continues the run overwrite would replace"
        if self.model.quantization.load_in_4bit and not self.model.lora.enabled:
            yield "model.quantization.load_in_4bit", ("needs model.lora.enabled=true: a 4-bit base stays frozen (QLoRA "
                                                      "trains LoRA adapters on it) and cannot be fine-tuned in full")


def ref_model_check(key: str, value: str | None, null_means: str):
    """The check of an optional reference-model field: null is allowed (it means `null_means`), blank text is not."""
    if value is not None and not value.strip():
        yield key, f"must be a model path or hub name, or null ({null_means})"


@dataclass(frozen=True)
class AlarmsConfig:
    """Thresholds of the alarms that configs can set (the others are `evaluation.alarms.AlarmThresholds` defaults)."""

    # alignment_tax: fires when the policy's mean per-token NLL of the capability set exceeds the reference's by more
    # than this many nats (0.1 = the reference texts' perplexity up 10.5%).
    alignment_tax_nats: Positive = 0.1


@dataclass(frozen=True)
class KLConfig:
    controller: Literal["fixed", "adaptive"] = "fixed"  # adaptive: Ziegler et al. 2019 proportional controller
    coef: NonNeg = 0.05  # β (the initial β when adaptive)
    target: Positive = 6.0  # adaptive: sequence KL (nats) to steer to
    horizon: PosInt = 10000  # adaptive: samples over which β moves by at most 20%
    # Measure objective/kl to the initial policy even where no KL term is trained (DAPO, Dr. GRPO: the drift monitor
    # the reward-hacking alarms read). null: with LoRA only, where it is free (the base with adapters disabled); true:
    # in full fine-tuning too, at the cost of a frozen copy of the policy (its weights' memory again) and one no-grad
    # forward per step; false: never.
    monitor: bool | None = None

    def check(self):
        if self.controller == "adaptive" and self.coef == 0:
            yield "controller", "adaptive needs coef > 0"


