"""FSDP1 and FSDP2 through accelerate, through the CLI, on 2 CPU processes (gloo): training, sampling, saving,
checkpoints and resumes of a run whose weights and optimizer state are sharded.

accelerate 1.15 chooses FSDP only on GPU-like devices; fsdp_on_cpu.py turns that one decision (and FSDP1's
`sync_module_states`) so that accelerate's own FSDP path — configs/accelerate/fsdp.yaml and fsdp2.yaml as
`accelerate launch` reads them — runs here. Each engine's jobs run in one torchrun (driver.py's job list); the
references run in this process (one process, the same global batch) or, for GRPO, under plain data parallel
(2 processes draw the same responses under either engine: sampling runs on the gathered policy)."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from driver import run_job  # noqa: E402
from common import assert_same_rows, assert_same_weights, free_port, rows, weights  # noqa: E402

pytestmark = pytest.mark.slow

ENGINES = {"fsdp1": "configs/accelerate/fsdp.yaml", "fsdp2": "configs/accelerate/fsdp2.yaml"}
B = 4  # per-process batch of the 2-process runs; the 1-process references use 2B
COMMON = ["max_steps=4", "logging.logging_steps=1", "logging.eval_steps=2", "logging.save_steps=2",
          "logging.progress_bar=false", "data.max_samples=64", "optim.warmup_steps=1"]
# name -> (argv, per-process batch of the 2-process runs; the 1-process references use twice that)
RUNS = {
    "sft": (["sft", "--config", "configs/sft_tiny.yaml"], B),
    # LoRA merged into full weights at the end (model.lora.merge_on_save), the adapter alone in the checkpoint
    "dpo-lora": (["dpo", "--config", "configs/dpo_tiny.yaml", "model.lora.enabled=true", "model.lora.dropout=0"], B),
    # 5 eval examples, per-process batch 2: shares of 3 and 2 examples, so 2 batches and 1; under a sharded model
    # every forward is collective (Trainer.eval_chunks)
    "sft-odd-eval": (["sft", "--config", "configs/sft_tiny.yaml", "data.eval=ODD:sft_eval"], 2),
    "kto-odd-eval": (["kto", "--config", "configs/kto_tiny.yaml", "data.eval=ODD:unpaired_eval"], 2),
}
GRPO = ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=3", "logging.save_steps=2", "logging.progress_bar=false",
        "optim.lr=1e-2", "optim.adam_eps=1e-4", "generation.max_new_tokens=8", "algo.rollout_batch_size=2",
        "optim.per_device_batch_size=4"]
# PPO with a critic of its own (policy, critic, one optimizer): FSDP1 only (accelerate's FSDP2 prepares one model)
PPO = ["ppo", "--config", "configs/ppo_tiny.yaml", "max_steps=3", "logging.save_steps=2", "logging.progress_bar=false",
       "optim.adam_eps=1e-4", "generation.max_new_tokens=8", "algo.rollout_batch_size=4", "algo.num_minibatches=1",
       "optim.per_device_batch_size=4", "optim.max_grad_norm=0.5"]
# RFT: 24 prompts in sampling batches of 8 — 3 batches, so 2 on one process and 1 on the other (sharding.py's
# gather, once per iteration, and the scoring's filler batch keep them in step)
RFT = ["rft", "--config", "configs/rft_tiny.yaml", "algo.prompts_per_iteration=24", "algo.sampling_batch_size=8",
       "generation.max_new_tokens=8", "logging.logging_steps=1", "logging.progress_bar=false"]
TIMEOUT_S = 420  # per torchrun: a hang fails the test instead of blocking the suite


def argv(name: str, out: str, world: int, *extra: str) -> list[str]:
    args, per_process = RUNS[name]
    # data.eval=ODD:NAME is the first 5 examples of data/tiny/NAME.jsonl, written by the fixture beside the runs
    args = [f"data.eval={os.path.dirname(out)}/odd_{a[len('data.eval=ODD:'):]}.jsonl" if a.startswith("data.eval=ODD:")
            else a for a in args]
    return [*args, f"output_dir={out}", f"optim.per_device_batch_size={per_process * 2 // world}", *COMMON, *extra]


def torchrun(script_args: list[str], jobs: list[dict], root, tag: str, codes: list[int] | None = None) -> subprocess.CompletedProcess:
    jobs_file, results = root / f"{tag}.json", root / f"{tag}-results"
    jobs_file.write_text(json.dumps(jobs))
    results.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), *script_args, str(jobs_file), str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    got = [json.loads(p.read_text()) if p.exists() else None for p in (results / "rank0.json", results / "rank1.json")]
    expected = codes or [0] * len(jobs)
    assert got == [expected] * 2, f"{tag}: exit codes {got}, expected {expected}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    d = lambda name: str(root / name)  # noqa: E731
    for name in ("sft_eval", "unpaired_eval"):
        with open(os.path.join(ROOT, "data", "tiny", f"{name}.jsonl"), encoding="utf-8") as f:
            (root / f"odd_{name}.jsonl").write_text("".join(f.readlines()[:5]))
    for name in RUNS:  # 1. references: one process, per-device batch 2B
        assert run_job({"argv": argv(name, d(f"{name}-1"), 1)}) == 0, name
    assert run_job({"argv": [*RFT, f"output_dir={d('rft-1')}", "optim.per_device_batch_size=8"]}) == 0
    logs = {}
    # 2. Each engine: fresh runs; resumes of its own checkpoint and of the 1-process run's; GRPO.
    for engine, config in ENGINES.items():
        jobs = [{"argv": argv(name, d(f"{name}-{engine}"), 2)} for name in RUNS]
        jobs += [{"copy": [d(f"sft-{engine}"), d(f"sft-{engine}-again")], "argv": argv("sft", d(f"sft-{engine}-again"), 2, "resume=true")},
                 {"copy": [d("sft-1"), d(f"sft-1-to-{engine}")], "argv": argv("sft", d(f"sft-1-to-{engine}"), 2, "resume=true")},
                 {"argv": [*GRPO, f"output_dir={d(f'grpo-{engine}')}"]},
                 {"argv": [*RFT, f"output_dir={d(f'rft-{engine}')}", "optim.per_device_batch_size=4"]}]
        codes = [0] * len(jobs)
        if engine == "fsdp1":
            jobs += [{"argv": [*PPO, f"output_dir={d('ppo-fsdp1')}"]},
                     {"copy": [d("ppo-fsdp1"), d("ppo-fsdp1-again")], "argv": [*PPO, f"output_dir={d('ppo-fsdp1-again')}", "resume=true"]},
                     {"argv": [*PPO, f"output_dir={d('ppo-lora-fsdp1')}", "model.lora.enabled=true"]}]
            codes += [0, 0, 2]  # the LoRA critic: refused
        else:
            jobs += [{"argv": [*PPO, f"output_dir={d('ppo-fsdp2')}"]}]
            codes += [2]  # two models under FSDP2: refused
        logs[engine] = torchrun([os.path.join(HERE, "fsdp_on_cpu.py"), config], jobs, root, engine, codes).stderr
    # 3. GRPO under plain data parallel, the same 2 processes.
    torchrun([os.path.join(HERE, "driver.py")], [{"argv": [*GRPO, f"output_dir={d('grpo-ddp')}"]},
                                                  {"argv": [*PPO, f"output_dir={d('ppo-ddp')}"]}], root, "ddp")
    # 4. An FSDP checkpoint resumed by one unsharded process.
    for engine in ENGINES:
        job = {"copy": [d(f"sft-{engine}"), d(f"sft-{engine}-to-1")], "argv": argv("sft", d(f"sft-{engine}-to-1"), 1, "resume=true")}
        assert run_job(job) == 0, engine
    return {"dir": d, "logs": logs}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_runs_are_sharded(runs, engine):
    """What accelerate did with the config file: the launch line every stage logs at start."""
    lines = [line for line in runs["logs"][engine].splitlines() if "rlhfkit: launch:" in line]
    assert len(lines) == len(RUNS) + 4 + (3 if engine == "fsdp1" else 1) and all("distributed type FSDP" in line for line in lines), lines


@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_sharded_run_equals_one_process(runs, engine, name):
    """The same metrics, and the final model and the checkpoint's written whole with the unsharded run's weights:
    for LoRA, the merged model at the end and the adapter alone in the checkpoint, as one process writes them."""
    one, sharded = runs["dir"](f"{name}-1"), runs["dir"](f"{name}-{engine}")
    assert_same_rows(rows(one), rows(sharded))
    assert_same_weights(one, sharded)
    assert sorted(os.listdir(os.path.join(one, "checkpoint-2", "model"))) == sorted(os.listdir(os.path.join(sharded, "checkpoint-2", "model")))
    assert_same_weights(os.path.join(one, "checkpoint-2", "model"), os.path.join(sharded, "checkpoint-2", "model"))
    if name == "dpo-lora":
        assert not os.path.exists(os.path.join(sharded, "adapter_config.json"))  # merged
        assert os.path.exists(os.path.join(sharded, "checkpoint-2", "model", "adapter_model.safetensors"))


@pytest.mark.parametrize("how", ["again", "1-to", "to-1"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_resume(runs, engine, how):
    """A sharded run resumed from its own checkpoint (same engine), one process's checkpoint resumed sharded, and a
    sharded checkpoint resumed by one process: each ends as the uninterrupted run. The optimizer state went through
    the checkpoint too: Adam's moments restarted from zero would move the weights by ~lr."""
    resumed = {"again": f"sft-{engine}-again", "1-to": f"sft-1-to-{engine}", "to-1": f"sft-{engine}-to-1"}[how]
    target = runs["dir"]("sft-1" if how == "1-to" else f"sft-{engine}")
    assert_same_rows(rows(target), rows(runs["dir"](resumed)))
    assert_same_weights(target, runs["dir"](resumed))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_grpo_samples_from_the_gathered_policy_as_data_parallel(runs, engine):
    """Online RL: the policy sampled under `gathered_weights` draws what data parallel draws (the same scores,
    lengths and KL at every step), and the run trains to the same weights."""
    ddp, sharded = rows(runs["dir"]("grpo-ddp")), rows(runs["dir"](f"grpo-{engine}"))
    assert [r["step"] for r in sharded] == [1, 2, 3]
    for a, b in zip(ddp, sharded):
        for key in ("objective/scores", "objective/kl", "response/length_avg", "loss/policy_avg", "episodes"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    wa, wb = weights(runs["dir"]("grpo-ddp")), weights(runs["dir"](f"grpo-{engine}"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert os.path.isdir(os.path.join(runs["dir"](f"grpo-{engine}"), "checkpoint-2"))


def test_ppo_with_its_own_critic_under_fsdp1_as_data_parallel(runs):
    """Policy and critic sharded as two FSDP1 models with one optimizer, their gradients clipped by one norm over
    both (max_grad_norm 0.5 clips here): the same metrics and weights as data parallel — policy and critic, at the
    end and in the checkpoint — and resumed from its checkpoint, the same end."""
    d = runs["dir"]
    ddp, sharded, again = rows(d("ppo-ddp")), rows(d("ppo-fsdp1")), rows(d("ppo-fsdp1-again"))
    assert [r["step"] for r in sharded] == [1, 2, 3]
    for a, b, c in zip(ddp, sharded, again):
        for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "objective/kl_coef"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
            assert c[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert ddp[0]["grad_norm"] > 0.5  # clipping was at work
    for where in ("", "checkpoint-2/model", "checkpoint-2/value_model"):
        wa, wb = weights(os.path.join(d("ppo-ddp"), where)), weights(os.path.join(d("ppo-fsdp1"), where))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{where} {k}: {m}")
    assert_same_weights(d("ppo-fsdp1"), d("ppo-fsdp1-again"))


@pytest.mark.parametrize("engine, message", [
    ("fsdp1", "rlhfkit: error: model.lora.enabled: PPO's LoRA critic"),
    ("fsdp2", "rlhfkit: error: PPO under FSDP2: accelerate prepares one model"),
])
def test_ppo_refusals_under_fsdp_are_one_line(runs, engine, message):
    errors = [line for line in runs["logs"][engine].splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 2 and all(line.startswith(message) for line in errors), errors  # one per process


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_rft_with_unequal_sampling_batches(runs, engine):
    """Best-of-n with 2 sampling batches on one process and 1 on the other (it hung under FSDP: each batch gathered
    the policy, a collective): the same kept samples, metrics and weights as one process."""
    one, sharded = runs["dir"]("rft-1"), runs["dir"](f"rft-{engine}")
    for it in (1, 2):
        with open(os.path.join(one, f"rft_iter{it}.jsonl")) as a, open(os.path.join(sharded, f"rft_iter{it}.jsonl")) as b:
            assert a.read() == b.read()
    assert_same_rows(rows(one), rows(sharded))
    assert_same_weights(one, sharded)
