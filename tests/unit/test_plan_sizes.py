"""The planner's parts against tensors actually allocated on the tiny model: weights, LoRA adapters, gradients,
AdamW's states, the KV cache and the logits, byte for byte; and the run's own check (plan.json, the start line, the
planned and measured peaks in metrics.jsonl)."""

import json
import os

import torch

from rlhfkit.config import ModelConfig
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.plan import plan_for
from rlhfkit.plan.layout import Forward, layout_of
from rlhfkit.plan.measure import LiveTensors
from rlhfkit.plan.memory import Precision, Sharding, logits_bytes, model_bytes, resident, trainable_params
from rlhfkit.plan.shape import load_shape
from rlhfkit.stages import build_stage_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def grpo_config(lora: bool, rows: int = 4, prompt: int = 24, new: int = 8):
    return build_stage_config("grpo", {"model": {"name_or_path": "tiny", "lora": {"enabled": lora, "r": 4}},
                                       "data": {"train": "x", "max_prompt_length": prompt, "max_length": 64},
                                       "output_dir": "x", "reward": {"function": "m:f"},
                                       "generation": {"max_new_tokens": new, "num_samples": 2},
                                       "algo": {"rollout_batch_size": rows // 2}, "optim": {"per_device_batch_size": 2}})


def test_weights_gradients_and_optimizer_states_are_the_allocated_ones():
    shape = load_shape("tiny", "model")
    p = Precision(4, 4, 4)
    model = load_causal_lm(ModelConfig(name_or_path="tiny"))
    assert nbytes(model.parameters()) == model_bytes(shape, "lm", 4, False)
    ids = torch.randint(0, shape.vocab, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    lay = layout_of("grpo", grpo_config(lora=False))
    assert nbytes(p.grad for p in model.parameters()) == trainable_params(lay) * 4
    states = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert nbytes(states) == resident(lay, p, Sharding())["optimizer"]


def test_lora_adapters_are_the_allocated_ones():
    cfg = grpo_config(lora=True)
    model = load_causal_lm(cfg.model)
    trained = [p for p in model.parameters() if p.requires_grad]
    lay = layout_of("grpo", cfg)
    assert nbytes(trained) == resident(lay, Precision(4, 4, 4), Sharding())["adapters"]
    assert sum(p.numel() for p in trained) == trainable_params(lay)


def test_kv_cache_and_logits_are_the_allocated_ones():
    rows, prompt, new = 4, 24, 8
    cfg = grpo_config(lora=False, rows=rows, prompt=prompt, new=new)
    gen = next(ph for ph in plan_for("grpo", cfg, device="cpu", suggest=False).phases if ph.name == "generation")
    model = load_causal_lm(cfg.model, trainable=False)
    ids = torch.randint(0, 50, (rows, prompt + new))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    kv = nbytes([t for layer in cache.layers for t in (layer.keys, layer.values)])
    assert kv == gen.parts["kv cache"]
    shape = load_shape("tiny", "model")
    # Without gradient: the logits in the compute dtype, plus one fp32 row of the log-softmax.
    assert nbytes([out.logits]) + (prompt + new) * shape.vocab * 8 == logits_bytes(
        shape, Forward(rows, prompt + new, prompt + new, False), Precision(4, 4, 4))


def test_update_peak_against_live_tensors():
    """The update's peak over the weights and optimizer states (activations and logits at the backward's start, or
    the gradients at its end), against the live-tensor tracker on a forward and backward of the tiny model with rows
    at the cap: within 10%."""
    from rlhfkit.models import token_logprobs

    cfg = build_stage_config("sft", {"model": {"name_or_path": "tiny"}, "data": {"train": "x", "max_length": 128,
                                     "max_prompt_length": 64}, "output_dir": "x", "optim": {"per_device_batch_size": 4}})
    update = next(ph for ph in plan_for("sft", cfg, device="cpu", suggest=False).phases if ph.name == "update")
    planned = update.total - update.parts["weights/policy"] - update.parts["optimizer"]
    model = load_causal_lm(cfg.model)
    model.train()
    tracker = LiveTensors()
    tracker.add_module(model)
    ids = torch.randint(0, 50, (4, 128))
    with tracker:
        base = tracker.current
        tracker.reset_peak()
        logprobs, mask = token_logprobs(model, ids, torch.ones_like(ids), ids)
        (-(logprobs * mask).sum()).backward()
        measured = tracker.peak - base
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)


def test_a_run_saves_its_plan_and_logs_both_peaks(tmp_path):
    from rlhfkit.stages import run_stage

    out = tmp_path / "run"
    run_stage("sft", os.path.join(ROOT, "configs", "sft_tiny.yaml"), [
        f"data.train={os.path.join(ROOT, 'data', 'tiny', 'sft_train.jsonl')}", "data.eval=null", f"output_dir={out}",
        "max_steps=2", "logging.progress_bar=false", "plan.measure=true"])
    plan = json.loads((out / "plan.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    memory = rows[-1]  # the last step's training metrics carry them
    assert memory["step"] == 2 and "loss" in memory and memory["memory/planned_peak_gb"] == plan["peak_gb"]
    assert 0 < memory["memory/peak_gb"] < memory["memory/peak_rss_gb"]
    assert plan["measured"]["memory/peak_gb"] == memory["memory/peak_gb"]
    assert "Memory: planned and measured (plan.json)" in (out / "report.html").read_text()


def test_static_cache_is_the_allocated_one():
    """generation.compile: transformers' StaticCache of the rounded-up length, allocated whole from the start."""
    from transformers import StaticCache

    from rlhfkit.generation.session import static_cache_length

    cfg = build_stage_config("grpo", {"model": {"name_or_path": "tiny"}, "data": {"train": "x", "max_prompt_length": 24,
                                      "max_length": 64}, "output_dir": "x", "reward": {"function": "m:f"},
                                      "generation": {"max_new_tokens": 8, "num_samples": 2, "compile": True},
                                      "algo": {"rollout_batch_size": 2}, "optim": {"per_device_batch_size": 2}})
    gen = next(ph for ph in plan_for("grpo", cfg, device="cpu", suggest=False).phases if ph.name == "generation")
    model = load_causal_lm(cfg.model, trainable=False)
    cache = StaticCache(config=model.config, max_cache_len=static_cache_length(32))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 50, (4, 32)), past_key_values=cache, use_cache=True)
    assert nbytes([t for layer in cache.layers for t in (layer.keys, layer.values)]) == gen.parts["kv cache"]


def test_the_tracker_counts_real_storage_only():
    """A run's tracker adds every tensor alive in the process at its start; a fake tensor left by torch.compile or
    export (a meta storage behind a CPU device) is counted as nothing, not a crash."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, dtype=torch.int64)
    real = torch.zeros(8, dtype=torch.int64)
    tracker = LiveTensors()
    tracker.add(fake, real)
    assert tracker.current == real.untyped_storage().nbytes() == 64
