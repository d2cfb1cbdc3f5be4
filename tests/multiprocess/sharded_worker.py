"""One process of `test_sharded_engines.py`: shard a tiny Llama over the processes (gloo, CPU) with FSDP1, FSDP2 and
DeepSpeed ZeRO-3 in turn, exactly as the engines do it under `accelerate launch` on GPUs (accelerate itself runs none
of them on CPU), and check `rlhfkit.sharding` against an unsharded copy of the same weights on each process.

    torchrun --nproc_per_node 2 tests/multiprocess/sharded_worker.py OUT_DIR fsdp1 fsdp2 [zero3]

Per engine:
  1. sampling under `gathered_weights` (before any training step) draws the same tokens, with the same log-probs,
     as the unsharded copy under the same seed; each process asks for a different number of new tokens, so a
     collective left inside the decode loop would hang (the test's timeout) instead of passing;
  2. on leaving, the weights are sharded again and a training step (SGD, each process its own batch) gives the same
     weights as the unsharded copy stepped with the gradient averaged over the processes (as DDP would);
  3. ZeRO-3: a state dict read inside `saved_weights` (what the main process saves) holds those whole weights;
  4. sampling after that step still matches the unsharded copy;
  ZeRO-3 also: a frozen copy in `zero3_inference_engine` gives the unsharded logits.
Writes OUT_DIR/rank{R}.json: {engine: {check: value}}.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from rlhfkit.config import GenerationConfig  # noqa: E402
from rlhfkit.generation import generate, seeded  # noqa: E402
from rlhfkit.sharding import gathered_weights, saved_weights, weight_layout, zero3_inference_engine  # noqa: E402
from rlhfkit.types import PromptBatch  # noqa: E402

EOS, PAD, VOCAB = 1, 0, 40
LR = 0.5


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every process
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def prompts():
    ids = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    return PromptBatch(ids, (ids != PAD).long())


def sample(model, rank: int, seed: int):
    # Rank r samples up to 4 + 12 r tokens: the processes stop at different steps. EOS is never drawn (its logit is
    # one of 40 random ones, but a response of a few tokens rarely hits it; the lengths differ either way).
    params = GenerationConfig(max_new_tokens=4 + 12 * rank, num_samples=2, temperature=1.0)
    with seeded(seed + rank):
        ro = generate(model, prompts(), params, EOS, PAD)
    return ro.response_ids, ro.sampler_logprobs


def full_weights(model, layout: str) -> dict[str, torch.Tensor]:
    """Every weight, whole, by its name in the plain model."""
    if layout == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    import deepspeed

    params = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().clone() for n, p in params}


def is_sharded(model, layout: str) -> bool:
    """Whether this process holds only its slice of the (first decoder layer's) weights again."""
    if layout == "fsdp2":
        p = model.model.layers[0].self_attn.q_proj.weight
        return p.to_local().shape[0] < p.shape[0]
    if layout == "fsdp1":  # use_orig_params: outside a summon each weight is a 1-D view of this process's shard
        return all(p.dim() == 1 for n, p in model.named_parameters() if "layers.0.self_attn.q_proj" in n)
    p = model.model.layers[0].self_attn.q_proj.weight
    return p.data.numel() == 0  # ZeRO-3: a placeholder outside a gather


def shard(model, engine: str, world: int):
    """(the sharded model to train and sample, an optimizer step function)."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return model, lambda loss: (loss.backward(), opt.step(), opt.zero_grad())
    if engine == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
        return wrapped, lambda loss: (loss.backward(), opt.step(), opt.zero_grad())
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; the unsharded copy does not clip
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # 0: tiny weights shard too
    engine_, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    return engine_, lambda loss: (engine_.backward(loss), engine_.step())


def reference_step(model, batch, world: int):
    """The unsharded copy's step: its own batch's gradient averaged over the processes (what DDP computes)."""
    model.train()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p -= LR * p.grad / world
            p.grad = None
    model.eval()


def check(engine: str, accelerator, rank: int, world: int) -> dict:
    plain = tiny_llama()
    sharded, step = shard(copy.deepcopy(plain), engine, world)
    module = sharded if engine == "fsdp1" else accelerator.unwrap_model(sharded)  # unwrap_model strips FSDP1 too
    layout = weight_layout(module)
    out = {"layout": layout}
    diffs = []
    for when, seed in (("before", 11), ("after", 23)):
        with gathered_weights(accelerator, sharded) as policy:
            ids, logprobs = sample(policy, rank, seed)
            if layout == "zero3":  # still gathered after the decode loop's forwards (no hook released them)
                out["zero3_still_gathered"] = policy.model.layers[0].self_attn.q_proj.weight.data.numel() == 32 * 32
        ref_ids, ref_logprobs = sample(plain, rank, seed)
        out[f"same_tokens_{when}"] = torch.equal(ids, ref_ids)
        out[f"logprob_diff_{when}"] = (logprobs - ref_logprobs).abs().max().item()
        out[f"response_width_{when}"] = ids.shape[1]
        out[f"sharded_again_{when}"] = is_sharded(module, layout)
        if when == "before":  # 2. one training step, each process its own batch
            batch = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 + rank))
            sharded.train()
            step(sharded(input_ids=batch, labels=batch).loss)
            sharded.eval()
            reference_step(plain, batch, world)
            full = full_weights(module, layout)
            diffs = [(full[n] - p).abs().max().item() for n, p in plain.named_parameters()]
            out["weights_max_diff"] = max(diffs)
            if layout == "zero3":
                with saved_weights(accelerator, sharded) as whole:  # what the main process saves
                    saved = whole.state_dict()
                out["saved_max_diff"] = max((saved[n] - p).abs().max().item() if saved[n].shape == p.shape
                                            else float("inf") for n, p in plain.named_parameters())
            out["weights_compared"] = len([n for n, _ in plain.named_parameters() if n in full])
    if engine == "zero3":
        frozen = zero3_inference_engine(copy.deepcopy(plain), {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
        ids = prompts().input_ids
        with torch.no_grad():
            out["frozen_engine_logit_diff"] = (frozen(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()
        out["frozen_engine_sharded"] = frozen.module.model.layers[0].self_attn.q_proj.weight.data.numel() == 0
    return out


def main():
    out_dir, engines = sys.argv[1], sys.argv[2:]
    if "zero3" in engines:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # MULTI_CPU on the gloo group above: the engines are applied by hand
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for engine in engines:
        results[engine] = check(engine, accelerator, rank, world)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
