"""Loading and saving models: policy, reference, reward and value models (transformers + peft).

Every loader takes a `ModelConfig`; `rlhfkit.model_sources.resolve_model_path` is the one place a name ("tiny", a
GGUF file, a directory, a hub name) becomes a path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import warnings

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.utils.error import NoMatchingPeftModuleError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
)

from rlhfkit.config import ModelConfig, QuantizationConfig
from rlhfkit.errors import UserError
from rlhfkit.forwards import attention_inputs, response_logits, scoring_forward, unwrap_peft
from rlhfkit.io import atomic_dir
from rlhfkit.model_sources import from_pretrained, resolve_model_path
from rlhfkit.precision import check_attn_implementation
from rlhfkit.sharding import place_frozen
from rlhfkit.templates import apply_setting

logger = logging.getLogger("rlhfkit")

PAD_TOKEN = "<|pad|>"  # added only when a tokenizer has neither a pad nor an eos token

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


# 1. Loading --------------------------------------------------------------------------------------------------


def load_tokenizer(cfg: ModelConfig, padding_side: str = "right", given=None):
    """The tokenizer of `cfg` (or the tokenizer object `given` from Python), with a pad token guaranteed.

    A tokenizer without a pad token gets pad = eos (with a warning), or, with no eos either, a new "<|pad|>" token;
    the model loaders then grow the embeddings to `len(tokenizer)`, so nothing else needs to be passed along.
    `cfg.chat_template` (model.chat_template) replaces its chat template (`rlhfkit.templates.apply_setting`).
    """
    if given is not None:
        tokenizer = given
    else:
        path = resolve_model_path(cfg)
        tokenizer = from_pretrained(AutoTokenizer, path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    apply_setting(tokenizer, cfg.chat_template)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            logger.warning("tokenizer of '%s' has no pad token: using eos %r as pad", cfg.name_or_path, tokenizer.eos_token)
            tokenizer.pad_token = tokenizer.eos_token
        else:
            logger.warning("tokenizer of '%s' has no pad or eos token: adding %r", cfg.name_or_path, PAD_TOKEN)
            tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    tokenizer.padding_side = padding_side
    return tokenizer


def _prepare(model: PreTrainedModel, cfg: ModelConfig, tokenizer, trainable: bool, task_type: str):
    """Shared tail of the loaders: pad id, embedding resize, then frozen, or checkpointing + LoRA."""
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # load_tokenizer added a pad token
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    quantized = getattr(model, "is_loaded_in_4bit", False)
    if quantized:
        _keep_cpu_layout(model)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
        return model
    if quantized:
        from peft import prepare_model_for_kbit_training

        # peft's QLoRA recipe: the base frozen, its half-precision norms and embeddings cast to fp32. Checkpointing is
        # left to the block below, the one place it is switched on (model.gradient_checkpointing).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # torch's recommended variant: works with frozen inputs and no_grad parts
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name; gradient_checkpointing_enable is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False  # the cache is useless while training and conflicts with checkpointing
        # transformers (and peft's wrapper) make the embedding's output require grad under checkpointing, which only
        # the reentrant variant needs: with the embedding frozen (LoRA, QLoRA) that output becomes a leaf whose own
        # (B, T, H) gradient is computed and kept with it as long as the loss is referenced (test_shared_critic.py).
        model.disable_input_require_grads()
    if cfg.lora.enabled:
        lora = PeftLoraConfig(
            task_type=task_type,
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
        )
        targets = cfg.lora.target_modules
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing` alias
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            try:
                model = get_peft_model(model, lora)
                model.get_base_model().disable_input_require_grads()  # peft turns it on again (see above)
                # peft ignores a list entry that matches nothing once another one matches: each must name a module
                # (peft's rule for lists: the module's full name or its last dotted parts).
                unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in model.targeted_module_names)] \
                    if isinstance(targets, list) else None
            except NoMatchingPeftModuleError:
                unmatched = targets
        if unmatched:
            raise UserError(f"config key 'model.lora.target_modules': {unmatched!r} matches no module of '{cfg.name_or_path}'; "
                            f"its linear modules are {', '.join(linear)} (or use 'all-linear')")
    return model


def _keep_cpu_layout(model) -> None:
    """Keep bitsandbytes from repacking a 4-bit model's CPU layers for its bf16 kernel.

    On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks a layer's weights at its first forward in eval mode without
    grad (sampling, scoring) and from then on runs every forward through that kernel, in training too: the kernel
    has no backward, so the gradients of the adapters below a layer come out wrong, and it computes in bf16, so sampling and training would not share one model. Each layer then keeps
    bitsandbytes' standard layout and math (dequantize, matmul in the compute dtype).
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _load_kwargs(cfg: ModelConfig, path: str) -> dict:
    check_attn_implementation(cfg.attn_implementation)  # every load path, `rlhfkit eval`'s too
    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, dtype=_DTYPES[cfg.dtype])
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.num_layers is not None:
        config = from_pretrained(AutoConfig, path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        have = getattr(config, "num_hidden_layers", None)
        if have is None:
            raise UserError(f"config key 'model.num_layers': model '{cfg.name_or_path}' has no num_hidden_layers to cut")
        if cfg.num_layers > have:  # transformers would add randomly initialised layers
            raise UserError(f"config key 'model.num_layers': model '{cfg.name_or_path}' has {have} layers, got {cfg.num_layers}")
        kwargs["num_hidden_layers"] = cfg.num_layers
    if (quantization := bnb_config(cfg.quantization)) is not None:
        # bitsandbytes quantizes while loading, onto the device the model runs on: this process's GPU (accelerate sets
        # the current device per process) or the CPU.
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        kwargs.update(quantization_config=quantization, device_map={"": device})
    return kwargs


def bnb_config(q: QuantizationConfig) -> BitsAndBytesConfig | None:
    """transformers' `BitsAndBytesConfig` for `q`, or None when the model is not quantized (`q.load_in_4bit` false).
    Whether bitsandbytes can run here was checked with the config (`QuantizationConfig.check`)."""
    if not q.load_in_4bit:
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.bnb_4bit_quant_type,
                              bnb_4bit_compute_dtype=_DTYPES[q.bnb_4bit_compute_dtype],
                              bnb_4bit_use_double_quant=q.bnb_4bit_use_double_quant)


def load_causal_lm(cfg: ModelConfig, tokenizer=None, *, trainable: bool = True, given=None):
    """A causal LM for a policy (trainable) or a frozen reference (`trainable=False`: eval mode, no grads, no LoRA).

    With `cfg.lora.enabled` and trainable, returns a peft model whose only trainable parameters are the adapters.
    The train/eval mode of a trainable model is left to the caller (from_pretrained returns it in eval mode).
    `given`: a model object from Python, prepared (pad id, LoRA, checkpointing) instead of loading `cfg`'s name.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    if given is not None:
        return _prepare(given, cfg, tokenizer, trainable, "CAUSAL_LM")
    path = resolve_model_path(cfg)
    model = from_pretrained(AutoModelForCausalLM, path, **_load_kwargs(cfg, path))
    return _prepare(model, cfg, tokenizer, trainable, "CAUSAL_LM")


def check_model_structure(cfg: ModelConfig, tokenizer, task_type: str = "CAUSAL_LM", given=None) -> None:
    """Refuse (a UserError) settings that contradict the model's structure — `model.num_layers` above its depth, LoRA
    `target_modules` that match none of its modules — from its config alone: the model is built on the meta device
    (no weights read), so a stage reports these before it reads its data. The loaders check the same at load time.
    `given`: a model object from Python, whose own config is read."""
    if given is not None:
        config = given.config
    else:
        path = resolve_model_path(cfg)
        _load_kwargs(cfg, path)  # model.num_layers against the config's depth
        if not cfg.lora.enabled:
            return
        config = from_pretrained(AutoConfig, path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if not cfg.lora.enabled:
        return
    if cfg.num_layers is not None:
        config.num_hidden_layers = cfg.num_layers
    auto = AutoModelForCausalLM if task_type == "CAUSAL_LM" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=cfg.trust_remote_code)
        _prepare(model, dataclasses.replace(cfg, gradient_checkpointing=False), tokenizer, True, task_type)


def load_reward_model(cfg: ModelConfig, tokenizer=None, *, trainable: bool = True, num_labels: int = 1,
                      allow_new_head: bool | None = None, key: str = "reward.model", hint: str = "", given=None):
    """A sequence-classification model (a backbone plus a linear `score` head) for reward or value modelling.

    From a causal-LM checkpoint the `score` head is new and randomly initialised from the global RNG: call
    `torch.manual_seed` first for a reproducible head. With LoRA (task SEQ_CLS) the head is trained in full next to
    the adapters (peft's modules_to_save). Read scores with `rlhfkit.rewards.sequence_scores`, not `model(...)`.

    `allow_new_head` says whether such a new head is accepted; by default only for a trainable model (the reward
    stage, a critic), since a frozen scorer with a random head scores noise. A refused directory is a UserError
    naming the config key `key` it came from, followed by `hint` (what to do about it).
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    if given is not None:
        model, info = _sequence_classifier_of(given, num_labels)
    else:
        path = resolve_model_path(cfg)
        model, info = from_pretrained(AutoModelForSequenceClassification, path, num_labels=num_labels,
                                      output_loading_info=True, **_load_kwargs(cfg, path))
    # Weights outside the backbone that the checkpoint lacks: the head was created here, at random.
    new_head = sorted(k for k in info["missing_keys"] if not k.startswith(model.base_model_prefix + "."))
    if new_head and not (trainable if allow_new_head is None else allow_new_head):
        raise UserError(f"config key '{key}': '{cfg.name_or_path}' holds no trained score head ('{new_head[0]}' is not in "
                        "its weights: a causal LM, not a reward model saved by `rlhfkit rm`)" + (f"; {hint}" if hint else ""))
    return _prepare(model, cfg, tokenizer, trainable, "SEQ_CLS")


def _sequence_classifier_of(model, num_labels: int):
    """A sequence-classification model built from a model object given from Python: the object itself when it is
    one (trained in place), else a new one of its architecture holding a copy of its backbone's weights and a new
    score head. Returns (model, loading info) as `from_pretrained(..., output_loading_info=True)` does."""
    if getattr(model, "score", None) is not None or type(model).__name__.endswith("ForSequenceClassification"):
        return model, {"missing_keys": []}
    config = copy.deepcopy(model.config)
    config.num_labels = num_labels
    classifier = AutoModelForSequenceClassification.from_config(config, dtype=next(model.parameters()).dtype)
    missing, _ = classifier.load_state_dict(model.state_dict(), strict=False)
    return classifier.to(next(model.parameters()).device), {"missing_keys": missing}


# 2. Saving ---------------------------------------------------------------------------------------------------


ADAPTER_DIR = "adapter"  # where a merged export keeps its LoRA adapter


def save_model(model, tokenizer, out_dir: str, *, merge_lora: bool = True) -> None:
    """Save `model` (and `tokenizer`, when given) as a plain Hugging Face directory, atomically.

    A peft model is merged into full weights, with the adapter alone beside them in `ADAPTER_DIR/` (what peft's
    `PeftModel.from_pretrained(base, ...)` loads), unless `merge_lora` is False, in which case only the adapter is saved;
    the merge runs on a CPU copy (`cpu_copy`), so `model` stays trainable and its device holds no second copy; a 4-bit base is merged as `merged_full_precision` does. `out_dir` is
    replaced only once everything is written: a failure midway leaves an existing `out_dir` untouched. `model` must
    already be unwrapped from accelerate/DDP.
    """
    with atomic_dir(out_dir) as tmp:  # same filesystem as out_dir, so the final rename is atomic
        if isinstance(model, PeftModel) and merge_lora and getattr(model.get_base_model(), "is_loaded_in_4bit", False):
            merged_full_precision(model).save_pretrained(tmp)
        elif isinstance(model, PeftModel) and merge_lora:
            cpu_copy(model).merge_and_unload().save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
        if isinstance(model, PeftModel) and merge_lora:  # the adapter too, small, for peft users and further training
            model.save_pretrained(os.path.join(tmp, ADAPTER_DIR))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers live on the CPU, made without a copy on `model`'s device.

    `copy.deepcopy` would clone every tensor where it lies (a second full model on the accelerator); here each tensor
    is copied straight to the CPU and handed to deepcopy through its memo, so the module tree (peft wrappers, tied
    weights: one tensor seen once) is rebuilt around the CPU tensors. Tensors on the meta device (a whole copy built
    around a gathered FSDP state dict keeps its non-persistent buffers there) hold no data: deepcopy copies them as
    they are.
    """
    memo: dict = {}
    for p in model.parameters():
        if not p.is_meta:
            memo[id(p)] = torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        if not b.is_meta:
            memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def merged_full_precision(model: PeftModel) -> PreTrainedModel:
    """A peft model on a 4-bit base as one plain model in `model.dtype`, on the CPU: its active adapter merged into the
    dequantized base weights, W = dequant(W_4bit) + ΔW. `model` is left as it is.

    The export computes what the trained model computed (the adapter learnt its update against the 4-bit weights),
    loads without bitsandbytes, and keeps the whole update: peft's merge into a 4-bit layer would quantize W + ΔW
    again, rounding most of a small ΔW away. Each 4-bit weight is dequantized where it lies and moved to the CPU at
    once, one layer at a time: the accelerator never holds more than one layer's full-precision weight (copying the
    model first would put a second 4-bit model, then a full-precision one, on it).
    """
    import bitsandbytes as bnb
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    name = model.active_adapter
    adapter = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    base = model.get_base_model()  # the LoRA layers injected: a 4-bit weight is at <module>.base_layer.weight
    dtype = base.config.dtype
    clean = lambda key: key.replace(".base_layer", "").replace(".original_module", "")  # noqa: E731
    state: dict[str, torch.Tensor] = {}
    quantized = {n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    for n in quantized:
        w = base.get_submodule(n).weight
        state[clean(f"{n}.weight")] = bnb.functional.dequantize_4bit(w.data, w.quant_state).to("cpu", dtype)
    for key, t in list(base.named_parameters()) + list(base.named_buffers()):
        if "lora_" in key or ".modules_to_save." in key or key.rsplit(".", 1)[0] in quantized:
            continue  # the adapter (set below), or a 4-bit weight done above
        state[clean(key)] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True)
    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    full = type(base)._from_config(config, dtype=dtype)
    persistent = set(full.state_dict())  # rotary inv_freq and the like are rebuilt, not loaded
    missing, unexpected = full.load_state_dict({k: v for k, v in state.items() if k in persistent}, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"4-bit export: weights missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")
    full.tie_weights()
    with warnings.catch_warnings():  # as in _prepare
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        merged = get_peft_model(full, copy.deepcopy(model.peft_config[name]))
    set_peft_model_state_dict(merged, adapter)
    return merged.merge_and_unload()


def token_logprobs(model, input_ids, attention_mask, labels, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs of `labels` under `model`, in fp32, shifted so position t scores token t+1.

    The one place a forward turns into log-probs for training (preference methods, online RL): the mask and position
    ids are `attention_inputs`' (left and right padding give the same values), and `temperature` must equal the
    sampling temperature where the tokens were sampled.

    Args:
        input_ids, attention_mask: (B, T).
        labels: (B, T), -100 where no log-prob is wanted (prompt, padding).

    Returns:
        logprobs: (B, T-1) fp32, 0 at masked positions.
        mask: (B, T-1) float, 1 on scored tokens.
        entropy: only with `with_entropy`: (B, T-1) fp32 entropy of the next-token distribution (at `temperature`)
            at each position, from the same logits; 0 at masked positions.
    """
    from rlhfkit.ops import entropy_from_logits, logprobs_from_logits

    logits, first = scored_logits(model, input_ids, attention_mask, labels)
    targets = labels[:, first + 1 :]  # (B, T-1-first)
    mask = targets != -100
    logprobs = logprobs_from_logits(logits[:, :-1], targets.masked_fill(~mask, 0), temperature)  # (B, T-1-first)
    pad = lambda x: torch.nn.functional.pad(x, (first, 0))  # noqa: E731  back to (B, T-1), nothing scored before
    if with_entropy:
        return pad(logprobs * mask), pad(mask.float()), pad(entropy_from_logits(logits[:, :-1], temperature) * mask)
    return pad(logprobs * mask), pad(mask.float())


def scored_logits(model, input_ids, attention_mask, labels, position_ids=None) -> tuple[torch.Tensor, int]:
    """Logits of positions `first`..T-1 only, where `first` is the first position that predicts a labelled token
    (labels[:, first + 1] != -100 in some row): ((B, T-first, V), first).

    The prompt's logits are wasted work (the LM head and its (T, V) log-softmax are a large share of a small model's
    step), so they are not computed where the model takes transformers' `logits_to_keep` (most causal LMs do);
    otherwise the full logits are computed and sliced. `logits[:, i]` predicts the token at `first + i + 1`. A padded
    batch runs with `attention_inputs(attention_mask)`; a padding-free row (`types.PaddingFreeBatch`) comes with no
    mask and its own `position_ids`.
    """
    scored = (labels[:, 1:] != -100).any(0)
    first = int(scored.float().argmax()) if bool(scored.any()) else labels.shape[1] - 1
    keep = labels.shape[1] - first  # >= 1 (0 would mean "all" to transformers)
    inputs = attention_inputs(attention_mask) if attention_mask is not None else {"attention_mask": None}
    if attention_mask is None and position_ids is not None:
        inputs["position_ids"] = position_ids  # a padding-free row: boundaries hold only without a KV cache
    logits = scoring_forward(model, input_ids, inputs, keep)
    return logits[:, logits.shape[1] - keep :], first


def rollout_logprobs(model, rollout, temperature: float = 1.0, with_entropy: bool = False):
    """(B, R) fp32 log-probs of a `Rollout`'s response tokens under `model`, at the sampling temperature; 0 on
    padding. With `with_entropy`, also the (B, R) entropies of the distributions those tokens were drawn from (same
    forward). The logits are `response_logits`': the response's positions only."""
    from rlhfkit.ops import entropy_from_logits, logprobs_from_logits

    logits = response_logits(model, rollout)  # (B, R, V)
    scored = rollout.response_mask != 0
    logprobs = logprobs_from_logits(logits, rollout.response_ids.masked_fill(~scored, 0), temperature) * scored
    if with_entropy:
        return logprobs, entropy_from_logits(logits, temperature) * scored  # (B, R), (B, R)
    return logprobs


def sequence_logprobs(model, input_ids, attention_mask, labels, temperature: float = 1.0):
    """Summed log-probs of the labelled tokens per sequence and their count: ((B,), (B,))."""
    logprobs, mask = token_logprobs(model, input_ids, attention_mask, labels, temperature)
    return logprobs.sum(-1), mask.sum(-1)


def sequence_logprobs_padding_free(model, batch, temperature: float = 1.0):
    """`sequence_logprobs` of a `types.PaddingFreeBatch` (S sequences in one row): ((S,), (S,)), each sequence's
    summed log-probs of its labelled tokens and their count, from one forward without padding."""
    from rlhfkit.ops import logprobs_from_logits, segment_sum

    labels = batch.next_token_labels  # (1, N)
    logits, first = scored_logits(model, batch.input_ids, None, labels, batch.position_ids)  # (1, N-first, V)
    targets = labels[0, first + 1 :]  # (N-1-first,)
    mask = targets != -100
    # In pieces of the longest sequence's length: one (T, V) fp32 copy at a time, as for a padded batch's rows.
    width = int(batch.seq_lens.max())
    logprobs = torch.cat([logprobs_from_logits(x[None], t[None], temperature)[0] for x, t in
                          zip(logits[0, :-1].split(width), targets.masked_fill(~mask, 0).split(width))]) * mask
    owner, n = batch.seq_ids[first + 1 :], len(batch.seq_lens)  # the sequence of each target token
    return segment_sum(logprobs, owner, n), segment_sum(mask, owner, n)


class Reference:
    """π_ref, frozen: a second model loaded with `trainable=False`, or — LoRA with no `ref_model` — the policy's own
    base with its adapters disabled, so the reference costs no memory beyond activations."""

    def __init__(self, cfg: ModelConfig, ref_model: str | None, policy, tokenizer, device, dtype: str | None = None,
                 copy_of=None):
        """`dtype`: the dtype a second model loads in (the run's `frozen_dtype`); None: `cfg.dtype`. `copy_of`: the
        policy's model object given from Python, before training: with no `ref_model` and no LoRA the reference is a
        frozen copy of it (its name may not be loadable)."""
        self.shared = ref_model is None and cfg.lora.enabled
        self.model = None
        if self.shared:
            return
        if ref_model is None and copy_of is not None:
            self.model = _prepare(copy.deepcopy(unwrap_peft(copy_of)), cfg, tokenizer, False, "CAUSAL_LM")
            if dtype is not None:
                self.model.to(_DTYPES[dtype] if dtype != "auto" else next(copy_of.parameters()).dtype)
        else:
            ref_cfg = cfg if ref_model is None else dataclasses.replace(cfg, name_or_path=ref_model, gguf_file=None)
            ref_cfg = dataclasses.replace(ref_cfg, dtype=dtype or cfg.dtype)
            self.model = load_causal_lm(ref_cfg, tokenizer, trainable=False)
        vocab = self.model.get_input_embeddings().num_embeddings
        if vocab != policy.get_input_embeddings().num_embeddings:
            raise UserError(
                f"reference model '{ref_model}' has a vocabulary of {vocab} tokens, the policy "
                f"{policy.get_input_embeddings().num_embeddings}: they must share the tokenizer"
            )
        self.model = place_frozen(self.model, device)  # ZeRO-3: a sharded inference engine (rlhfkit.sharding)

    def sequence_logprobs(self, policy, input_ids, attention_mask, labels) -> torch.Tensor:
        """Summed reference log-probs of the labelled tokens, (B,), without gradient. `policy` is the unwrapped
        (accelerate-free) policy, used only when the reference is its base."""
        with self.frozen(policy) as model:
            logprobs, _ = sequence_logprobs(model, input_ids, attention_mask, labels)
        return logprobs

    def rollout_logprobs(self, policy, rollout, temperature: float = 1.0) -> torch.Tensor:
        """(B, R) reference log-probs of a `Rollout`'s response tokens (see `rollout_logprobs`), without gradient."""
        with self.frozen(policy) as model:
            return rollout_logprobs(model, rollout, temperature)

    @contextlib.contextmanager
    def frozen(self, policy):
        """The reference model, under no_grad: the second model, or `policy` with its adapters disabled."""
        if not self.shared and self.model is None:
            raise RuntimeError("the reference model was released after its log-probs were precomputed")
        with torch.no_grad(), policy.disable_adapter() if self.shared else contextlib.nullcontext():
            yield policy if self.shared else self.model

    def sync(self, policy, alpha: float) -> None:
        """TR-DPO's reference update from the unwrapped `policy` (`mix_weights`); a second model only."""
        if self.model is None:
            raise RuntimeError("only a reference that is a model of its own can be synced with the policy")
        mix_weights(self.model, policy, alpha)

    def release(self) -> None:
        """Free a second model once its log-probs are precomputed."""
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@torch.no_grad()
def mix_weights(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """θ_target ← α·θ_source + (1 - α)·θ_target for every parameter, matched by name; α = 1 copies `source`.

    TR-DPO's reference update (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment",
    arXiv 2404.09656, §3: the soft update with weight α, the hard update at α = 1), applied every τ steps by the
    caller. Each product is taken in the target's dtype (a reference held in bf16 stays bf16). A parameter missing
    on either side raises UserError: the two are not the same architecture.
    """
    theirs = dict(source.named_parameters())
    ours = dict(target.named_parameters())
    if ours.keys() != theirs.keys():
        missing = sorted(ours.keys() ^ theirs.keys())[:3]
        raise UserError(f"algo.sync_ref_model: the reference and the policy differ in their parameters ({', '.join(missing)}"
                        " ...): the reference must be the policy's architecture")
    for name, param in ours.items():
        update = theirs[name].detach().to(param.dtype)
        if alpha == 1:
            param.copy_(update)
        else:
            param.mul_(1 - alpha).add_(update, alpha=alpha)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability in `model` to 0 (dropout layers, LoRA's adapter dropout, and the attention
    dropout rate that transformers' attention modules keep as a float); returns how many were non-zero.

    The online trainers do it by default (`algo.disable_dropout`, as TRL's `disable_dropout`): the ratio π/π_old of
    PPO-style losses compares two forwards of the same weights, and dropout makes it differ from 1 at lr = 0.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def set_training(module: torch.nn.Module, training: bool) -> None:
    """`module.train(training)`, unless every submodule is in that mode already. A real switch of a transformers model
    chooses its hub kernels again for the mode (`PreTrainedModel.train` kernelizes), so an online step switches the
    policy once per phase (sampling and the no-grad forwards in eval mode, the update in train mode), not around each
    part. Every submodule is read, not the root's flag alone: a peft wrapper is made in train mode around a model
    that `from_pretrained` left in eval mode."""
    if any(m.training != training for m in module.modules()):
        module.train(training)
