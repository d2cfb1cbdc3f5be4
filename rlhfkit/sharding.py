"""Sharded engines — FSDP1, FSDP2 and DeepSpeed ZeRO-3, as `accelerate launch` sets them up: what sampling, saving
and the frozen models need once each process holds only a slice of every weight.

1. Sampling. A training forward gathers each layer's weights and frees them again, which is all a training step
   needs; a decode loop runs one forward per new token, so it would gather the whole model once per token. Those
   gathers are collective: every process would have to run the same number of forwards, but each stops when its
   own responses have ended (rlhfkit's decode loop keeps no processes in step; transformers' `generate` does, with
   `synced_gpus`, which it turns on for FSDP-managed and ZeRO-3 models). `gathered_weights` gathers the weights once
   per call instead — a full copy of the policy on each process while it samples, as TRL's
   `unwrap_model_for_generation` does for ZeRO-3 — after which sampling runs no collective: each process samples
   alone, for as many steps as its own responses need. FSDP1's root unit (embeddings, final norm, LM head) is
   gathered only by the FSDP wrapper's own forward, which sampling never calls (it calls the wrapped model's):
   without the gather, sampling fails there ("'weight' must be 2-D").
2. Saving and resuming. The main process writes the model; under ZeRO-3 it would write its placeholders (empty
   tensors), under FSDP its shards: checkpoints and the final model are written inside `saved_weights`, which every
   process enters. Under FSDP it gathers torch's full state dict (`get_model_state_dict`, collective) and the main
   process writes a plain copy of the model holding it (`whole_copy`), so LoRA merges and peft's adapter files come
   out as from an unsharded run. A resume loads the checkpoint into that copy and hands it to every process
   (`loaded_weights`); the optimizer state goes through torch's full, name-keyed optimizer state dict
   (`optimizer_state`, `load_optimizer_state`), so a checkpoint resumes at any world size, sharded or not.
3. Frozen models (a reference that is not the LoRA base, reward models) have no optimizer state to shard. Under
   ZeRO-3 with `zero3_init_flag`, `from_pretrained` returns them already partitioned and nothing could run them, so
   `place_frozen` gives each a DeepSpeed inference engine (ZeRO-3, no optimizer) that gathers its layers in every
   forward. Under FSDP and ZeRO-1/2 they stay whole on every process (see `place_frozen` for why).
4. accelerate's DeepSpeed `prepare` needs the micro-batch size, which it otherwise reads from a data loader that
   rlhfkit does not hand it: `configure_deepspeed`.

5. Keeping processes in step. Every forward of a sharded model is collective: loops whose number of batches differs
   between processes (evaluation shares, RFT's sampling batches) give the short processes filler batches
   (`OfflineTrainer.eval_chunks`, `RFTTrainer.best_of_n`).

accelerate 1.15 runs none of these engines on CPU by itself (see the table in docs/distributed.md): FSDP needs a GPU-type device
(`AcceleratorState` picks FSDP only for GPU-like multi-device types; its FSDP1 plugin with `sync_module_states`
raises "There are currently no available devices found"), and with `ACCELERATE_USE_CPU` DeepSpeed is ignored; on
several CPU processes without it accelerate finds no backend and runs each process alone (one process runs:
DeepSpeed's CPU accelerator, gloo). The functions here dispatch on how the weights are held, not on accelerate's
state. Tests shard tiny models with torch and DeepSpeed directly on 2 CPU processes, and run the CLI under
accelerate's own FSDP path with that one device decision changed (tests/multiprocess/fsdp_on_cpu.py).
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch


def fsdp_classes() -> tuple[type | None, type | None]:
    """(FSDP1's FullyShardedDataParallel, FSDP2's FSDPModule); None where this torch lacks one."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed support
        return None, None
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            FSDPModule = None
    return FullyShardedDataParallel, FSDPModule


def weight_layout(module: torch.nn.Module) -> str:
    """How `module` (no DDP or DeepSpeedEngine around it) holds its weights: "fsdp1" (an FSDP1 wrapper), "fsdp2" (`fully_shard` applied), "zero3" (DeepSpeed ZeRO-3 partitioned parameters, which carry a `ds_id`)
    or "whole" (every process has every weight: one process, DDP, ZeRO-1/2)."""
    fsdp1, fsdp2 = fsdp_classes()
    if fsdp1 is not None and isinstance(module, fsdp1):
        return "fsdp1"
    if fsdp2 is not None and isinstance(module, fsdp2):
        return "fsdp2"
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return "zero3"
    return "whole"


@contextlib.contextmanager
def gathered_weights(accelerator, model, unwrapped=None):
    """The policy's module (unwrapped: call `generate` on it), with its full weights on this process for the whole
    `with` block; they are sharded again on leaving it, unchanged (writes to them are dropped). `model` is
    the prepared model (or its unwrapped module); `unwrapped`, its unwrapped module when the caller holds it (accelerate's
    `unwrap_model` costs milliseconds a call). Every process must enter together: gathering is collective; leaving
    is not.

    - whole (one process, DDP, ZeRO-1/2): the unwrapped module, nothing gathered;
    - FSDP2: every `fully_shard`-ed module unsharded once, with `reshard_after_forward` off meanwhile so no forward
      frees what was gathered; on leaving, resharded and `reshard_after_forward` set back to the value accelerate
      sharded them with (its FSDP plugin's, root included; True for a model sharded by hand);
    - FSDP1: every unit's weights summoned (`summon_full_params`, `writeback=False`) and the wrapped model yielded,
      with each inner unit's forward (one per decoder layer) pointed at its wrapped module's for the block: an FSDP1
      unit's own forward gathers and frees its weights again at every call, summoned or not, and FSDP1 has no
      public switch for that;
    - ZeRO-3: every parameter gathered (`deepspeed.zero.GatheredParameters`, read-only) and kept gathered through the
      forwards (see below).
    """
    fsdp1, _ = fsdp_classes()
    layout, sharded, module = _layout_of(accelerator, model, unwrapped)
    if layout == "fsdp1":
        module = sharded  # the wrapper: its root unit's weights are summoned through it
    if layout == "fsdp2":
        _, fsdp2 = fsdp_classes()
        units = [m for m in module.modules() if isinstance(m, fsdp2)]
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        restore = getattr(plugin, "reshard_after_forward", True)
        module.set_reshard_after_forward(False)
        try:
            for unit in units:  # the same order on every process: each unshard is an all-gather
                unit.unshard()
            yield module
        finally:
            for unit in units:
                unit.reshard()
            module.set_reshard_after_forward(restore if isinstance(restore, bool) else True)
    elif layout == "fsdp1":
        units = [m for m in module.module.modules() if isinstance(m, fsdp1)]
        with fsdp1.summon_full_params(module, recurse=True, writeback=False):
            for unit in units:
                unit.forward = unit.module.forward  # an instance attribute: shadows FSDP's forward until deleted
            try:
                yield module.module
            finally:
                for unit in units:
                    del unit.forward
    elif layout == "zero3":
        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            # ZeRO-3's hooks stay on the modules and, after each submodule's forward, free its weights again unless
            # they are persistent (ds_persist, DeepSpeed's flag for weights too small to shard): so they are, meanwhile.
            persistent = [p.ds_persist for p in params]
            for p in params:
                p.ds_persist = True
            try:
                yield module
            finally:
                for p, flag in zip(params, persistent):
                    p.ds_persist = flag
    else:
        yield module


def _layout_of(accelerator, model, unwrapped=None) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(weight layout, the module torch's state-dict functions take, the unwrapped module) of a prepared model.
    accelerate's `unwrap_model` strips an FSDP1 wrapper, whose state-dict functions need the wrapper itself."""
    fsdp1, _ = fsdp_classes()
    inner = unwrapped if unwrapped is not None else accelerator.unwrap_model(model)
    if fsdp1 is not None and isinstance(model, fsdp1):
        return "fsdp1", model, model.module if inner is model else inner
    layout = weight_layout(inner)
    if layout == "fsdp2":
        # A forward without backward (evaluation, the rollout's no-grad forwards) leaves the root unit unsharded
        # (FSDP2 does not reshard the root after its forward): its module then holds unsharded tensors in place of the
        # parameters the optimizer holds. Resharding (a no-op for sharded units) puts the optimizer's back.
        _, fsdp2 = fsdp_classes()
        for unit in inner.modules():
            if isinstance(unit, fsdp2):
                unit.reshard()
    return layout, inner, inner


def weight_layout_of(accelerator, model, unwrapped=None) -> str:
    """`weight_layout` of a prepared model (an FSDP1 wrapper included); `unwrapped` as for `gathered_weights`."""
    return _layout_of(accelerator, model, unwrapped)[0]


def _state_dict_options(module, **kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # On GPUs the full state dict is gathered into CPU memory on the main process only (the other processes get {}).
    # On CPU processes it stays where it is, on every process: FSDP1's CPU offload crashes there (SIGSEGV, torch 2.13).
    on_gpu = next(module.parameters()).device.type != "cpu"
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu, **kwargs)


def _plain_class(module: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps each `fully_shard`-ed module's class for a subclass (FSDPLlamaForCausalLM)."""
    _, fsdp2 = fsdp_classes()
    return next(c for c in type(module).__mro__ if fsdp2 is None or not issubclass(c, fsdp2))


def whole_copy(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (unsharded) model of `module`'s structure — a transformers model, or a peft model on one — holding
    `state`, a full state dict of it: built on the meta device, then the tensors of `state` put in place (no copy).
    The savers then write it as they write an unsharded model (merging LoRA, peft's adapter files, tied weights)."""
    from peft import PeftModel

    base = module.get_base_model() if isinstance(module, PeftModel) else module
    with torch.device("meta"):
        plain = _plain_class(base)._from_config(copy.deepcopy(base.config))
        if isinstance(module, PeftModel):
            first, *others = list(module.peft_config)
            plain = _plain_class(module)(plain, copy.deepcopy(module.peft_config[first]), adapter_name=first)
            for name in others:
                plain.add_adapter(name, copy.deepcopy(module.peft_config[name]))
            plain.set_adapter(module.active_adapter)
    _, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()  # a tied head takes the embeddings, whichever of the two names the state dict kept
    missing = [name for name, t in plain.state_dict().items() if t.device.type == "meta"]
    if missing or unexpected:
        raise RuntimeError(f"the gathered state dict does not fit {type(plain).__name__}: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return plain


@contextlib.contextmanager
def saved_weights(accelerator, model, unwrapped=None):
    """The module the main process saves (unwrapped), whole. Every process must enter (gathering is collective):
    - ZeRO-3: every weight gathered in place for the `with` block;
    - FSDP1 / FSDP2: the full state dict gathered, and a `whole_copy` holding it on the main process (None on the
      others, which write nothing);
    - otherwise: the unwrapped module as it is. `unwrapped` as for `gathered_weights`."""
    layout, sharded, module = _layout_of(accelerator, model, unwrapped)
    if layout == "zero3":
        with gathered_weights(accelerator, model, module) as whole:
            yield whole
    elif layout in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(sharded, options=_state_dict_options(sharded))
        yield whole_copy(module, state) if accelerator.is_main_process else None
    else:
        yield module


def loaded_weights(accelerator, model, load, unwrapped=None) -> None:
    """Load weights into a prepared model with `load(module)`, which fills an unsharded module in place (a
    checkpoint's files, read by the main process). Sharded models (FSDP, ZeRO-3): `load` fills the main process's
    whole copy (`saved_weights`), then every process takes its slice of it. Every process must call this."""
    layout, sharded, module = _layout_of(accelerator, model, unwrapped)
    if layout in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        with saved_weights(accelerator, model, module) as whole:
            if whole is not None:
                load(whole)
            state = whole.state_dict() if whole is not None else {}
            set_model_state_dict(sharded, state, options=_state_dict_options(sharded, broadcast_from_rank0=True))
    elif layout == "zero3":
        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):  # the main process's values, spread out
            if accelerator.is_main_process:
                load(module)
    else:
        load(module)


def _optimized(accelerator, models: list) -> tuple[str, torch.nn.Module]:
    """(layout, one module holding every parameter of `models`) for torch's optimizer state functions: the model's
    own module, or the models side by side in a ModuleList (PPO's policy and critic)."""
    layouts = [_layout_of(accelerator, m) for m in models]
    kinds = {layout for layout, _, _ in layouts}
    layout = next((k for k in ("fsdp1", "fsdp2", "zero3") if k in kinds), "whole")
    holder = layouts[0][1] if len(layouts) == 1 else torch.nn.ModuleList([s for _, s, _ in layouts])
    return layout, holder


def _by_name(accelerator, holder, optimizer) -> bool:
    """Whether torch's name-keyed optimizer state functions can read `optimizer`: not DeepSpeed's own optimizer, and
    no parameter outside `holder`."""
    if accelerator.distributed_type == "DEEPSPEED":
        return False
    own = {id(p) for p in holder.parameters()}
    return all(id(p) in own for group in optimizer.param_groups for p in group["params"])


def _is_by_name(state: dict) -> bool:
    return any(isinstance(k, str) for group in state.get("param_groups", []) for k in group.get("params", []))


def optimizer_state(accelerator, models: list, optimizer) -> dict:
    """What a checkpoint keeps of the optimizer of the prepared `models`. Collective under FSDP (every process must
    call it).

    The full state keyed by parameter name (torch's `get_optimizer_state_dict`) where torch can read the optimizer
    (see `_by_name`): the same dict from a sharded or an unsharded run, so the checkpoint resumes in any layout and at
    any world size. Under DeepSpeed, the optimizer's own `state_dict()` (keyed by position; this process's
    partition): it resumes in the layout that wrote it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _, holder = _optimized(accelerator, models)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
    if not _by_name(accelerator, holder, inner):
        return optimizer.state_dict()
    return get_optimizer_state_dict(holder, inner, options=_state_dict_options(holder))


def load_optimizer_state(accelerator, models: list, optimizer, state: dict, where: str) -> None:
    """Load what `optimizer_state` returned (every process holds all of it; each keeps its slice). `where` names
    the checkpoint in the error for a position-keyed state that a sharded model cannot take."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    layout, holder = _optimized(accelerator, models)
    inner = getattr(optimizer, "optimizer", optimizer)
    if _is_by_name(state):
        set_optimizer_state_dict(holder, inner, copy.deepcopy(state), options=_state_dict_options(holder))
    elif layout in ("fsdp1", "fsdp2"):
        from rlhfkit.errors import UserError

        raise UserError(f"{where}: its optimizer state is keyed by position (written by an older rlhfkit or under "
                        f"DeepSpeed), which a sharded model cannot load; resume it in the layout that wrote it")
    else:
        optimizer.load_state_dict(state)


DEEPSPEED_STATE = "deepspeed"  # a checkpoint's "optimizer" entry when its optimizer state is DeepSpeed's own (deepspeed/)


def save_deepspeed_state(accelerator, directory: str) -> str:
    """Under DeepSpeed, the optimizer state of every process's partition, written by DeepSpeed itself into `directory`
    (its `save_checkpoint`: every process must call this); returns `DEEPSPEED_STATE`, what the checkpoint records in
    place of an optimizer state. DeepSpeed's own `state_dict()` is this process's partition only, and holds objects
    that `torch.load(weights_only=True)` refuses: such checkpoints did not resume at all."""
    accelerator.deepspeed_engine_wrapped.engine.save_checkpoint(directory, tag="state", save_latest=False)
    accelerator.wait_for_everyone()
    return DEEPSPEED_STATE


def load_deepspeed_state(accelerator, checkpoint: str, recorded) -> None:
    """Load what `save_deepspeed_state` wrote into checkpoint directory `checkpoint` (every process, each its own
    partition; the world size must be the one that wrote it). A checkpoint written with DeepSpeed resumes only with
    it, and one without it not under it: a UserError naming the checkpoint."""
    from rlhfkit.errors import UserError

    if accelerator.distributed_type != "DEEPSPEED":
        raise UserError(f"{checkpoint}: its optimizer state is DeepSpeed's (written under DeepSpeed); resume it with the "
                        f"same DeepSpeed launch and world size")
    if recorded != DEEPSPEED_STATE:
        raise UserError(f"{checkpoint}: written without DeepSpeed; DeepSpeed cannot take its optimizer state: resume it "
                        f"without DeepSpeed, or start a new run")
    engine = accelerator.deepspeed_engine_wrapped.engine
    # The weights come along (the same as the checkpoint's model files); the learning-rate schedule is rlhfkit's own.
    engine.load_checkpoint(os.path.join(checkpoint, "deepspeed"), tag="state", load_optimizer_states=True,
                           load_lr_scheduler_states=False)


def stepped_optimizer(accelerator, optimizer):
    """The optimizer a loop steps: without an fp16 scaler, on one process or under DDP, accelerate's wrapper only
    passes each call on (probing the installed packages at every step), so the loop steps torch's optimizer itself;
    otherwise accelerate's wrapper, which has work to do."""
    if accelerator.scaler is None and accelerator.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return getattr(optimizer, "optimizer", optimizer)
    return optimizer


def clip_grad_norm(accelerator, models: list, max_norm: float) -> torch.Tensor | None:
    """accelerate's `clip_grad_norm_` over the gradients of several prepared models at once (None entries skipped):
    one norm over all of them, every gradient scaled by the same factor; whole gradients (one process, DDP) go
    through `_clip_whole`. Under FSDP accelerate computes a global norm only when handed exactly one model's
    `parameters()` (otherwise a norm of this process's shards): each model's norm is measured by its FSDP1 wrapper
    (PPO under FSDP2 is refused), and the total clipped here. `max_norm` inf: measured only (whole gradients: nothing
    scaled, not even by 1)."""
    import math

    models = [m for m in models if m is not None]
    whole = accelerator.distributed_type not in ("FSDP", "DEEPSPEED", "XLA")
    if whole and hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return _clip_whole(accelerator, [p for m in models for p in m.parameters()], max_norm)
    if len(models) == 1:
        return accelerator.clip_grad_norm_(models[0].parameters(), max_norm)
    if accelerator.distributed_type != "FSDP":
        return accelerator.clip_grad_norm_([p for m in models for p in m.parameters()], max_norm)
    # accelerate would compare the parameter lists tensor by tensor (and fail on shards of unequal sizes): each FSDP1
    # model measures its own global norm (max_norm inf: nothing clipped yet), after accelerate's fp16 unscaling.
    accelerator.unscale_gradients()
    norms = torch.stack([m.clip_grad_norm_(math.inf).float() for m in models])
    total = torch.linalg.vector_norm(norms)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's own clipping factor
    for m in models:
        for p in m.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
    return total


def _clip_whole(accelerator, parameters: list, max_norm: float) -> torch.Tensor:
    """accelerate's `clip_grad_norm_` where every process holds whole gradients (one process, DDP), without the probe
    of optional packages it makes at every call: fp16 gradients unscaled, then the norm of the per-group norm and the
    clip as accelerate computes them, so the values are its own bit for bit."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    accelerator.unscale_gradients()
    with_grad = [p for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([get_total_norm([p.grad for p in with_grad])]), 2)
    if max_norm != float("inf"):
        clip_grads_with_norm_(with_grad, max_norm, total)
    return total


def zero3_inference_engine(model: torch.nn.Module, ds_config: dict):
    """A DeepSpeed ZeRO-3 engine for a frozen model: its weights partitioned over the processes (as the policy's),
    gathered layer by layer in each forward; no optimizer, scheduler or optimizer offload (a frozen model has no
    state to keep). `ds_config` is the policy's DeepSpeed config, copied, not changed. The engine is returned in
    eval mode; calling it runs the model's forward (and it passes attribute reads through to the model)."""
    import deepspeed

    config = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    config.setdefault("zero_optimization", {})["stage"] = 3
    config["zero_optimization"].pop("offload_optimizer", None)
    # The batch-size keys only have to be consistent for an engine that never steps; accelerate resolves "auto" only
    # when it prepares the policy, which may come after this.
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = 1
    for section in ("fp16", "bf16"):  # "auto": accelerate has set the mixed precision in its own copy already
        if isinstance(config.get(section), dict) and config[section].get("enabled") == "auto":
            config[section]["enabled"] = False
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def place_frozen(model: torch.nn.Module, device):
    """Where a frozen model (a reference that is not the LoRA base, a reward model) lives beside the policy.

    - DeepSpeed ZeRO-3 (accelerate's state says so): a ZeRO-3 inference engine (`zero3_inference_engine`), sharded
      like the policy. Its forwards are collective: every process must run the same number of them (the online
      trainer's rollout forwards are; a loop that gives processes different numbers of batches must not call it).
    - everything else — one process, DDP, ZeRO-1/2 and FSDP: the whole model on `device` on every process. Under
      FSDP this is a choice: accelerate shards one model per `prepare` call and only with an optimizer (FSDP2), and a
      frozen model sharded by hand would make every forward of it collective, for a saving that LoRA (the reference
      is then the policy's own base) already gives. The cost is one copy per GPU: a 7B reference in bf16 is 14 GB.
    """
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DistributedType

    if is_initialized():
        state = AcceleratorState()
        if state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3:
            return zero3_inference_engine(model, state.deepspeed_plugin.deepspeed_config)
    return model.to(device)


def configure_deepspeed(accelerator, per_device_batch_size: int) -> None:
    """Under DeepSpeed, state the micro-batch size that accelerate's `prepare` otherwise reads from a data loader
    (rlhfkit prepares none: without this it raises "When using DeepSpeed, `accelerate.prepare()` requires you to pass
    at least one of training or evaluation dataloaders ..."). DeepSpeed uses it for its batch-size bookkeeping only;
    rlhfkit cuts its own micro-batches. A value the DeepSpeed config file sets is kept."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_device_batch_size
