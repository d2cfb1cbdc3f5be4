"""Sharded engines on 2 CPU processes (gloo): `rlhfkit.sharding` under FSDP1, FSDP2 and (when `deepspeed` is installed)
DeepSpeed ZeRO-3, each applied by hand to a tiny Llama as accelerate applies it on GPUs (accelerate 1.15 runs none of
them on CPU: see rlhfkit/sharding.py). What each process checks is in sharded_worker.py; here the answers are read.
"""

import importlib.util
import json
import shutil
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "sharded_worker.py")
TIMEOUT = 240  # a collective left in the decode loop hangs: the timeout turns that into a failure
sys.path.insert(0, HERE)
from common import free_port  # noqa: E402

ENGINES = ["fsdp1", "fsdp2"] + (["zero3"] if importlib.util.find_spec("deepspeed") else [])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), WORKER, str(out), *ENGINES]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_sampling_from_gathered_weights_equals_the_unsharded_model(results, engine):
    """Same seed, same tokens and log-probs as the unsharded copy, before and after a training step; the processes
    sampled different numbers of steps (4 vs 16 new tokens at most) without waiting for each other."""
    for rank, res in enumerate(results):
        r = res[engine]
        assert r["layout"] == engine
        for when in ("before", "after"):
            assert r[f"same_tokens_{when}"], (rank, when)
            assert r[f"logprob_diff_{when}"] < 1e-5, (rank, when)
            assert r[f"sharded_again_{when}"], (rank, when)
        if engine == "zero3":
            assert r["zero3_still_gathered"]
    assert results[0][engine]["response_width_before"] < results[1][engine]["response_width_before"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_training_step_after_gathering_equals_data_parallel(results, engine):
    """After the gather is undone, one sharded SGD step (each process its own batch) gives the weights of the
    unsharded copy stepped with the process-averaged gradient; under ZeRO-3, gathered again, they are what a save writes."""
    for res in results:
        assert res[engine]["weights_compared"] == 21  # every weight of the 2-layer model, embeddings and head included
        assert res[engine]["weights_max_diff"] < 1e-5
        if engine == "zero3":
            assert res[engine]["saved_max_diff"] < 1e-5  # a save inside saved_weights writes them whole


@pytest.mark.slow
@pytest.mark.skipif("zero3" not in ENGINES, reason="deepspeed is not installed (pip install 'rlhfkit[deepspeed]')")
def test_frozen_model_in_a_zero3_inference_engine(results):
    for res in results:
        assert res["zero3"]["frozen_engine_sharded"]
        assert res["zero3"]["frozen_engine_logit_diff"] < 1e-5


# accelerate runs DeepSpeed on CPU with one process (DeepSpeed's CPU accelerator, gloo): the whole rlhfkit path — the
# micro-batch size handed to accelerate, models built already partitioned (zero3_init_flag), sampling from the
# gathered policy, a frozen reference in a ZeRO-3 inference engine, the final model saved whole — against the same run
# without accelerate. stage3_param_persistence_threshold 0 partitions even the tiny model's weights (by default
# DeepSpeed keeps tensors under 100k elements whole). One backward per optimizer step: see docs/distributed.md on DeepSpeed and
# gradient accumulation.
DS_CONFIG = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
             "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 1
use_cpu: false
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: true
"""


@pytest.mark.slow
@pytest.mark.skipif("zero3" not in ENGINES, reason="deepspeed is not installed (pip install 'rlhfkit[deepspeed]')")
@pytest.mark.parametrize("stage, zero, args", [
    ("grpo", 3, ["max_steps=2", "optim.per_device_batch_size=16", "generation.max_new_tokens=8"]),  # 4 prompts x 4
    ("dpo", 3, ["max_steps=3"]),  # a separate reference model (no LoRA)
    # PPO: policy and a separate critic prepared as one module (DeepSpeed takes one model per Accelerator)
    ("ppo", 2, ["max_steps=2", "algo.ppo_epochs=2", "algo.num_minibatches=2", "algo.rollout_batch_size=16"]),
    ("ppo", 3, ["max_steps=2", "algo.ppo_epochs=2", "algo.num_minibatches=2", "algo.rollout_batch_size=16"]),
    # Several micro-batches per optimizer step: one DeepSpeed step over their summed gradients (accelerate stepped
    # the engine at every backward: 2 optimizer steps a step)
    ("grpo", 3, ["max_steps=2", "optim.per_device_batch_size=8", "generation.max_new_tokens=8"]),  # 16 rows, 2 x 8
    ("sft", 2, ["max_steps=3", "optim.per_device_batch_size=8", "optim.grad_accum_steps=2", "data.eval=null"]),
], ids=["grpo-zero3", "dpo-zero3", "ppo-zero2", "ppo-zero3", "grpo-zero3-two-micro-batches", "sft-zero2-grad-accum"])
def test_accelerate_zero3_one_cpu_process_equals_the_plain_run(stage, zero, args, tmp_path):
    from safetensors.torch import load_file

    ds = dict(DS_CONFIG, zero_optimization={"stage": 2}) if zero == 2 else DS_CONFIG
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "zero3.yaml").write_text(ACCELERATE_CONFIG.format(ds=tmp_path / "ds.json").replace(
        "zero3_init_flag: true", f"zero3_init_flag: {str(zero == 3).lower()}"))
    common = [stage, "--config", f"configs/{stage}_tiny.yaml", "logging.progress_bar=false", "optim.adam_eps=1e-4", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("ACCELERATE_USE_CPU", None)  # with it accelerate ignores DeepSpeed
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "zero3.yaml"),
              "--main_process_port", str(free_port()), "-m", "rlhfkit.cli"]
    runs = {}
    for name, cmd in (("plain", [sys.executable, "-m", "rlhfkit.cli"]), ("zero3", launch)):
        out = tmp_path / name
        r = subprocess.run([*cmd, *common, f"output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-4000:]
        runs[name] = out
    assert "distributed type DEEPSPEED" in r.stderr
    rows = {k: [json.loads(line) for line in (v / "metrics.jsonl").read_text().splitlines()] for k, v in runs.items()}
    assert len(rows["plain"]) == len(rows["zero3"])
    for a, b in zip(rows["plain"], rows["zero3"]):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith(("time/", "elapsed")):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    plain, zero3 = load_file(runs["plain"] / "model.safetensors"), load_file(runs["zero3"] / "model.safetensors")
    for k in plain:
        assert zero3[k].shape == plain[k].shape, k  # saved whole, not the partition placeholders
        assert (zero3[k] - plain[k]).abs().max() < 1e-5, k


@pytest.mark.skipif("zero3" not in ENGINES, reason="deepspeed is not installed (pip install 'rlhfkit[deepspeed]')")
def test_ppo_lora_critic_under_deepspeed_is_refused_in_one_line(tmp_path):
    """The LoRA critic is backpropagated apart from the policy and DeepSpeed steps at every backward: refused with
    exit 2 and one line naming the key, before any step (it failed inside DeepSpeed's gradient hooks)."""
    ds = dict(DS_CONFIG, zero_optimization={"stage": 2})
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "zero2.yaml").write_text(ACCELERATE_CONFIG.format(ds=tmp_path / "ds.json").replace(
        "zero3_init_flag: true", "zero3_init_flag: false"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("ACCELERATE_USE_CPU", None)
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "zero2.yaml"),
                        "--main_process_port", str(free_port()), "-m", "rlhfkit.cli", "ppo", "--config",
                        "configs/ppo_tiny.yaml", "model.lora.enabled=true", "max_steps=1", f"output_dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    # rlhfkit's process: one line and exit 2 (the traceback after it is accelerate's launcher reporting the exit).
    assert "rlhfkit: error: model.lora.enabled: PPO's LoRA critic" in r.stderr and "(exitcode: 2)" in r.stderr, r.stderr[-3000:]
    assert f'File "{ROOT}/rlhfkit' not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif("zero3" not in ENGINES, reason="deepspeed is not installed (pip install 'rlhfkit[deepspeed]')")
@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_checkpoint_resumes_to_the_uninterrupted_run(zero, tmp_path):
    """A checkpoint written under DeepSpeed holds DeepSpeed's own optimizer state (checkpoint-N/deepspeed/, every
    process its partition): resumed, the run ends where the uninterrupted one ends. Its trainer_state.pt held
    DeepSpeed's state_dict before, which `torch.load(weights_only=True)` refused: resume=true found no checkpoint."""
    from safetensors.torch import load_file

    ds = dict(DS_CONFIG, zero_optimization={"stage": 2}) if zero == 2 else DS_CONFIG
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "ds.yaml").write_text(ACCELERATE_CONFIG.format(ds=tmp_path / "ds.json").replace(
        "zero3_init_flag: true", f"zero3_init_flag: {str(zero == 3).lower()}"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("ACCELERATE_USE_CPU", None)
    args = ["sft", "--config", "configs/sft_tiny.yaml", "logging.progress_bar=false", "max_steps=4", "logging.save_steps=2",
            "data.eval=null", "optim.per_device_batch_size=8", "logging.logging_steps=1"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    for out, extra in ((full, []), (resumed, ["resume=true"])):
        if extra:
            shutil.copytree(full, out)  # the finished run resumes from checkpoint-2 and redoes steps 3 and 4
        r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "ds.yaml"),
                            "--main_process_port", str(free_port()), "-m", "rlhfkit.cli", *args, f"output_dir={out}", *extra],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(os.listdir(full / "checkpoint-2")) == ["deepspeed", "model", "trainer_state.pt"]
    assert "resuming from" in r.stderr
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, resumed)]
    assert [round(r["loss"], 6) for r in rows[0]] == [round(r["loss"], 6) for r in rows[1]]
