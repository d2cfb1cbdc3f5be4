"""The planner's step time from a given table of rates, against times computed by hand on a small hand-made shape;
the rates file that ships is a measured one, and a device without measurements is planned and said to be unmeasured."""

import math

import pytest

from rlhfkit.plan import plan_for
from rlhfkit.plan.devices import Device, device_named
from rlhfkit.plan.layout import layout_of
from rlhfkit.plan.shape import ModelShape
from rlhfkit.plan.timing import decode_seconds, measured_rates, rates_for, step_time
from rlhfkit.stages import build_stage_config

# 2 layers; per layer the linears q, k, v, o (4x4 each) and gate, up, down (4x8): 160 weights, 320 in all; the LM
# head 10x4. A token multiplies through 360 weights.
SHAPE = ModelShape(family="llama", vocab=10, hidden=4, layers=2, heads=2, kv_heads=2, head_dim=2, intermediate=8,
                   tied=False, qkv_bias=False, qk_norm=False, dtype="float32")
DEVICE = Device("test-device", 1.0, 1e3, 1e2, "a test sheet")
RATES = {"train_flops": 1000.0, "forward_flops": 1000.0, "decode_bytes": 100.0,
         "layer_train": {"full": 0.5, "lora+ckpt": 0.75}, "layer_forward": {"full": 0.1}, "layer_decode": {"full": 0.2},
         "token_train": {"full": 0.001}, "token_forward": {"full": 0.002}, "logit_train": 0.0001,
         "logit_forward": 0.0005, "call_train": 0.25, "call_forward": 0.05, "decode_token": 0.3,
         "optimizer_param": 0.001,
         "optimizer_tensor": 0.01, "stage_step": {"sft": 2.0, "grpo": 1.5}, "threads": 1, "source": "by hand"}
TABLE = {"test-device": RATES}
SFT_DATA = {"train": "x", "max_length": 3, "max_prompt_length": 1}


def layout(stage: str, **sections):
    data = {"model": {"name_or_path": "hand-made"}, "data": {"train": "x"}, "output_dir": "x", **sections}
    return layout_of(stage, build_stage_config(stage, data), lambda *args: SHAPE)


def test_sft_step_by_hand():
    lay = layout("sft", data=SFT_DATA, optim={"per_device_batch_size": 2})
    # forward: 2 FLOPs x 360 weights x 6 tokens + attention 2 x 2 layers x 2 rows x 3² x 2 heads x 2 = 4320 + 288;
    # full fine-tuning: 3x that (forward, backward twice) at 1000 FLOP/s
    compute = 3 * 4608 / 1000
    # two layers' forward+backward, each 6 tokens over widths 4 + 8; one call; 2 x 3 tokens' logits over 10 entries
    fixed = 2 * (0.5 + 0.001 * 12 * 6) + 0.25 + 0.0001 * 10 * 6
    # AdamW: 420 parameters (embedding 40, linears 320, norms 2 x 2 x 4 + 4, head 40) in 21 tensors
    optimizer = 420 * 0.001 + 21 * 0.01
    t = step_time(lay, DEVICE, 0, 4, TABLE)
    assert t.phases == pytest.approx({"update": compute + fixed + optimizer, "stage": 2.0})
    assert t.seconds == pytest.approx(13.824 + 1.4 + 0.63 + 2.0)
    assert t.measured and t.basis == "by hand"


def test_lora_with_checkpointing_by_hand():
    lay = layout("sft", data=SFT_DATA, optim={"per_device_batch_size": 2, "grad_accum_steps": 2},
                 model={"name_or_path": "hand-made", "gradient_checkpointing": True,
                        "lora": {"enabled": True, "r": 1}})
    # LoRA: the backward computes activation gradients only (1x the forward), checkpointing a second forward: 3x;
    # two micro-batches; the adapters: r x (in + out) per linear, 8+8+8+8+12+12+12 = 68 a layer, 28 tensors. No
    # per-token cost measured for LoRA with checkpointing: LoRA's, then full fine-tuning's (0.001) is used
    micro = 3 * 4608 / 1000 + 2 * (0.75 + 0.001 * 12 * 6) + 0.25 + 0.0001 * 10 * 6
    t = step_time(lay, DEVICE, 0, 4, TABLE)
    assert t.phases["update"] == pytest.approx(2 * micro + 136 * 0.001 + 28 * 0.01)


def test_decode_by_hand():
    lay = layout("grpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                 generation={"max_new_tokens": 2, "num_samples": 2}, algo={"rollout_batch_size": 1},
                 optim={"per_device_batch_size": 2})
    r = rates_for(DEVICE, TABLE)
    # prefill: 2 rows x 2 tokens: 2 x 360 x 4 + attention 2 x 2 x 2 x 2² x 2 x 2 = 2880 + 128 FLOPs; two layers' and
    # one call's fixed cost; per layer 4 tokens over widths 4 + 8; one logit a row
    prefill = 3008 / 1000 + 2 * (0.1 + 0.002 * 12 * 4) + 0.05 + 0.0005 * 10 * 2
    # a decode step reads the weights (1000 bytes) and the KV cache: 2 (K, V) x 2 layers x 2 rows x 2 heads x 2 dims x
    # 4 bytes = 128 bytes a position, 2 + 2/2 positions on average; bytes-bound (1384 B at 100 B/s beats
    # 1472 FLOPs at 1000/s)
    step = 1384 / 100 + 2 * 0.2 + 0.3
    assert decode_seconds(lay, r, 1000, 4) == pytest.approx(prefill + 2 * step)


def test_online_frozen_forwards_run_once_a_rollout_not_once_an_epoch():
    one, two = (layout("grpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                       generation={"max_new_tokens": 2, "num_samples": 2}, optim={"per_device_batch_size": 2},
                       algo={"rollout_batch_size": 2, "ppo_epochs": epochs}) for epochs in (1, 2))
    assert (one.micro_batches, one.frozen_batches) == (2, 2) and (two.micro_batches, two.frozen_batches) == (4, 2)


def test_rft_spreads_an_iterations_sampling_over_its_sft_steps():
    lay = layout("rft", reward={"function": "m:f"}, max_steps=4,
                 algo={"prompts_per_iteration": 4, "sampling_batch_size": 2}, generation={"num_samples": 2})
    assert lay.generations_per_step == 0.5  # two sampling batches, four SFT steps


def test_unmeasured_device_is_planned_at_sheet_rates_and_says_so():
    gpu = device_named("H100")
    r = rates_for(gpu, {})
    assert not r.measured and "unmeasured" in r.source
    assert r.train_flops == pytest.approx(0.4 * 989e12)
    assert rates_for(gpu, {"H100-80GB": RATES}).measured


def test_the_shipped_cpu_rates_are_measured_and_name_their_threads():
    cpu = measured_rates()["cpu"]
    assert cpu["threads"] >= 1 and "thread" in cpu["source"] and "plan_calibrate" in cpu["source"]
    cfg = build_stage_config("sft", {"model": {"name_or_path": "tiny"}, "data": {"train": "x"}, "output_dir": "x"})
    plan = plan_for("sft", cfg, device="cpu", suggest=False)
    assert plan.time_measured and f"{cpu['threads']} thread" in plan.time_basis
    assert math.isclose(plan.seconds_per_step, sum(plan.time_phases.values()))


def test_pi_old_forward_is_counted_only_where_the_run_recomputes_it():
    def grpo(**algo):
        return layout("grpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                      generation={"max_new_tokens": 2, "num_samples": 2}, optim={"per_device_batch_size": 2},
                      algo={"rollout_batch_size": 1, **algo})

    r = rates_for(DEVICE, TABLE)
    assert grpo().pi_old == "free"  # one pass over each rollout: the update's own forward is π_old
    assert grpo(old_logprob_source="recompute").pi_old == "recompute"
    lay = grpo(ppo_epochs=2)
    assert lay.pi_old == "free_in_fp32"  # the sampler's log-probs in fp32, a forward of its own under bf16
    from rlhfkit.plan.timing import frozen_seconds

    # π_old: 2 rows x 4 tokens, logits on the response only: 2 x 360 x 8 + attention 2 x 2 x 2 x 4² x 2 x 2 = 5760 +
    # 512 FLOPs; per layer 0.1 + 0.002 x 12 x 8; one call; 2 x 2 logits over 10 entries
    pi_old = 6272 / 1000 + 2 * (0.1 + 0.002 * 12 * 8) + 0.05 + 0.0005 * 10 * 4
    assert frozen_seconds(lay, r, 2) - frozen_seconds(lay, r, 4) == pytest.approx(pi_old)


def test_tool_rounds_by_hand():
    """With tools, each round (tools.max_calls of them) appends a result of at most tools.max_result_tokens to the
    calling rows and feeds it as one no-grad forward over the KV cache; every episode's prompt is rendered once and
    each of its turns parsed (`rollout.tool_loop`). Its decode steps stay bounded by max_new_tokens."""
    sections = dict(data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                    generation={"max_new_tokens": 2, "num_samples": 2}, algo={"rollout_batch_size": 1},
                    optim={"per_device_batch_size": 2})
    plain = layout("grpo", **sections)
    lay = layout("grpo", **sections, tools={"functions": ["m:f"], "max_calls": 2, "max_result_tokens": 1})
    r = rates_for(DEVICE, {"test-device": {**RATES, "tool_render": 0.07, "tool_parse": 0.03}})
    # a round: 2 rows x 1 token over the cache of 2 + 2/2 positions: 2 x 360 x 2 FLOPs + attention 4 x 2 layers x
    # 2 rows x 1 x (3 + 1/2) x 2 heads x 2 dims = 1440 + 224; two layers' fixed cost with 2 tokens over widths 4 + 8;
    # one call; one logit a row
    round_ = 1664 / 1000 + 2 * (0.1 + 0.002 * 12 * 2) + 0.05 + 0.0005 * 10 * 2
    # two renders (one an episode) and three parses an episode (the first turn and one after each round)
    python = 2 * 0.07 + 2 * 3 * 0.03
    assert decode_seconds(lay, r, 1000, 4) - decode_seconds(plain, r, 1000, 4) == pytest.approx(2 * round_ + python)
    # without max_calls a round is planned (the length alone limits them; the plan cannot know how many calls)
    unset = layout("grpo", **sections, tools={"functions": ["m:f"], "max_result_tokens": 1})
    assert unset.generation.rounds == 1 and plain.generation.rounds == 0


def test_a_tool_result_is_planned_at_most_the_completion_it_is_part_of():
    lay = layout("online_dpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                 generation={"max_new_tokens": 2, "num_samples": 2}, optim={"per_device_batch_size": 2},
                 tools={"functions": ["m:f"], "max_calls": 3})
    assert (lay.generation.rounds, lay.generation.result_len) == (3, 2)  # max_result_tokens 1024, 2 new tokens


def test_a_timed_cell_is_scaled_step_by_step_by_the_probe_run_after_it():
    """bench/plan_grid.py's time pass: each step's CPU seconds times the probe's reference over the probe's seconds
    after that step; the median after the first step (RFT: the mean of its second iteration)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "bench"))
    from plan_grid import measured_s, normalised

    row = {"stage": "sft", "steps_cpu_s": [9.0, 4.0, 6.0, 3.0], "probe_cpu_s": [1.0, 2.0, 3.0, 1.0],
           "measured_cpu_s": 4.0}
    # scaled by 1.5 / probe: 13.5, 3, 3, 4.5; the median of the last three
    assert normalised(row, 1.5) == pytest.approx(3.0)
    assert normalised({**row, "stage": "rft"}, 1.5) == pytest.approx((3 + 4.5) / 2)
    # without a reference or probes, the raw figure
    assert measured_s(row, None) == 4.0 and measured_s({**row, "probe_cpu_s": []}, 1.5) == 4.0


def test_a_layers_cost_per_token_has_a_part_of_its_own_beside_the_part_per_width():
    """bench/plan_calibrate.py fits a layer's per-token cost at two widths: a part per token (the dispatch of its
    elementwise ops, whatever the width) and a part per element of hidden + intermediate."""
    lay = layout("sft", data=SFT_DATA, optim={"per_device_batch_size": 2})
    rates = {**RATES, "layer_token_train": {"full": 0.004}}
    # as test_sft_step_by_hand, each layer's 6 tokens costing 0.004 more
    t = step_time(lay, DEVICE, 0, 4, {"test-device": rates})
    assert t.seconds == pytest.approx(13.824 + 1.4 + 0.63 + 2.0 + 2 * 0.004 * 6)
    # and a no-grad forward's: π_old of test_pi_old_forward_is_counted_only_where_the_run_recomputes_it, 8 tokens
    from rlhfkit.plan.timing import frozen_seconds

    grpo = layout("grpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                  generation={"max_new_tokens": 2, "num_samples": 2}, optim={"per_device_batch_size": 2},
                  algo={"rollout_batch_size": 1, "ppo_epochs": 2})
    with_token = rates_for(DEVICE, {"test-device": {**RATES, "layer_token_forward": {"full": 0.005}}})
    r = rates_for(DEVICE, TABLE)
    assert frozen_seconds(grpo, with_token, 2) - frozen_seconds(grpo, r, 2) == pytest.approx(2 * 2 * 0.005 * 8)


def test_a_calls_weight_traffic_by_hand():
    """Each call spends per weight it multiplies through (360 here: the linears and the head) what bench/
    plan_calibrate.py measured at two batch sizes: a training call `param_train` (full fine-tuning: the weights read
    and their gradients written), frozen weights `param_forward` each time they are read."""
    traffic = {"test-device": {**RATES, "param_train": 0.01, "param_forward": 0.001}}
    sft = layout("sft", data=SFT_DATA, optim={"per_device_batch_size": 2})
    t = step_time(sft, DEVICE, 0, 4, traffic)
    assert t.seconds == pytest.approx(13.824 + 1.4 + 0.63 + 2.0 + 360 * 0.01)
    lora = layout("sft", data=SFT_DATA, optim={"per_device_batch_size": 2},
                  model={"name_or_path": "hand-made", "gradient_checkpointing": True, "lora": {"enabled": True, "r": 1}})
    # frozen weights read in the forward, the backward and the recomputed forward
    assert step_time(lora, DEVICE, 0, 4, traffic).seconds - step_time(lora, DEVICE, 0, 4, TABLE).seconds == \
        pytest.approx(360 * 3 * 0.001)
    r, plain = rates_for(DEVICE, traffic), rates_for(DEVICE, TABLE)
    grpo = layout("grpo", data={"train": "x", "max_prompt_length": 2}, reward={"function": "m:f"},
                  generation={"max_new_tokens": 2, "num_samples": 2}, algo={"rollout_batch_size": 1},
                  optim={"per_device_batch_size": 2})
    assert decode_seconds(grpo, r, 1000, 4) - decode_seconds(grpo, plain, 1000, 4) == pytest.approx(360 * 0.001)
