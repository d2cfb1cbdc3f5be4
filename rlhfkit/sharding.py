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
2. Saving. The main process writes the model; under ZeRO-3 it would write its placeholders (empty tensors):
   checkpoints and the final model are written inside `saved_weights`, which every process enters. Under FSDP a
   whole state dict needs accelerate's collective `get_state_dict` (FSDP's state-dict hooks return shards even
   inside a gather), which rlhfkit's savers do not use yet: FSDP saves are not handled (README).
3. Frozen models (a reference that is not the LoRA base, reward models) have no optimizer state to shard. Under
   ZeRO-3 with `zero3_init_flag`, `from_pretrained` returns them already partitioned and nothing could run them, so
   `place_frozen` gives each a DeepSpeed inference engine (ZeRO-3, no optimizer) that gathers its layers in every
   forward. Under FSDP and ZeRO-1/2 they stay whole on every process (see `place_frozen` for why).
4. accelerate's DeepSpeed `prepare` needs the micro-batch size, which it otherwise reads from a data loader that
   rlhfkit does not hand it: `configure_deepspeed`.

accelerate 1.15 runs none of these engines on CPU (see the README's table): FSDP needs a GPU-type device
(`AcceleratorState` picks FSDP only for GPU-like multi-device types; its FSDP1 plugin with `sync_module_states`
raises "There are currently no available devices found"), and with `ACCELERATE_USE_CPU` DeepSpeed is ignored; on
several CPU processes without it accelerate finds no backend and runs each process alone (one process runs:
DeepSpeed's CPU accelerator, gloo). The functions here dispatch on how the weights are held, not on accelerate's
state, so tests shard tiny models with torch and DeepSpeed directly on 2 CPU processes and check them there.
"""

from __future__ import annotations

import contextlib
import copy

import torch


def _fsdp_classes() -> tuple[type | None, type | None]:
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
    fsdp1, fsdp2 = _fsdp_classes()
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
    fsdp1, _ = _fsdp_classes()
    # accelerate's unwrap_model also strips an FSDP1 wrapper (1.15), leaving a model whose root weights stay sharded.
    if fsdp1 is not None and isinstance(model, fsdp1):
        module = model
    else:
        module = unwrapped if unwrapped is not None else accelerator.unwrap_model(model)
    layout = weight_layout(module)
    if layout == "fsdp2":
        _, fsdp2 = _fsdp_classes()
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


@contextlib.contextmanager
def saved_weights(accelerator, model):
    """The module the main process saves (unwrapped), whole: under ZeRO-3 every weight gathered for the `with` block
    (every process must enter: gathering is collective); otherwise `unwrap_model`'s module as it is."""
    module = accelerator.unwrap_model(model)
    if weight_layout(module) == "zero3":
        with gathered_weights(accelerator, model) as whole:
            yield whole
    else:
        yield module


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
