"""bench/agent_results.py: the agent demo's figures over seeds, as the docs' table, by hand."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import agent_results  # noqa: E402  (bench/ is not a package)


def figures(done, fmt, calls, turns):
    return {"task_completion": done, "format_accuracy": fmt, "calls_per_episode": calls, "turns_per_episode": turns}


def test_mean_and_sample_sd_over_seeds_with_each_seed_beside():
    runs = [{"methods": {"sft": figures(0.5, 0.9, 1.0, 2.0)}}, {"methods": {"sft": figures(0.7, 1.0, 0.5, 1.5)}}]
    # task completion: mean 0.6, sample sd sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414 -> 14.1 points
    assert agent_results.rows(runs) == [["SFT", "60.0% ± 14.1 (50.0%, 70.0%)", "95.0% ± 7.1 (90.0%, 100.0%)",
                                         "0.75 ± 0.35 (1.00, 0.50)", "1.75 ± 0.35 (2.00, 1.50)"]]


def test_one_run_is_its_figures_alone():
    assert agent_results.rows([{"methods": {"grpo_no_tools": figures(0.0, 0.25, 0.0, 1.0)}}]) == [
        ["GRPO, without tools", "0.0%", "25.0%", "0.00", "1.00"]]



def test_main_reads_a_pipeline_run_wall_time_per_stage_from_its_record(tmp_path, monkeypatch):
    # `rlhfkit demo --agent` runs a pipeline: eval/eval.json has no timings; pipeline.json records each stage's seconds.
    # Seed 0: 60 s, 1260 s, 876 s -> 1.0, 21.0, 14.6 minutes, 2196 s in all -> 36.6; seed 1's prompts stage was done
    # by an earlier command (skipped): named apart, not counted (120 s + 60 s -> 2.0 + 1.0 = 3.0).
    import json

    stages = {0: [("prompts", "ran", 60.0), ("sft", "ran", 1260.0), ("grpo", "resumed", 876.0)],
              1: [("prompts", "skipped", 0.0), ("sft", "ran", 120.0), ("grpo", "ran", 60.0)]}
    runs = []
    for seed, records in stages.items():
        run = tmp_path / f"agent{seed}"
        (run / "eval").mkdir(parents=True)
        done = 1.0 if seed else 0.5
        (run / "eval" / "eval.json").write_text(json.dumps({
            "quick": False, "seed": seed, "eval_prompts": 24, "methods": {"grpo": figures(done, 1.0, 1.0, 2.0),
                                                                          "sft": figures(0.0, 1.0, 0.0, 1.0)},
            "acceptance": {"grpo_task_completion>=0.80": done >= 0.8}}))
        (run / "pipeline.json").write_text(json.dumps({"stages": {}, "records": [
            {"name": n, "status": st, "seconds": sec} for n, st, sec in records]}))
        runs.append(str(run))
    written = {}
    monkeypatch.setattr(agent_results, "record", lambda name, title, columns, rows, **kw: written.update(rows=rows, **kw))
    monkeypatch.setattr(sys, "argv", ["agent_results.py", *runs])
    assert agent_results.main() == 0
    assert written["rows"][0] == ["GRPO", "75.0% ± 35.4 (50.0%, 100.0%)", "100.0% ± 0.0 (100.0%, 100.0%)",
                                  "1.00 ± 0.00 (1.00, 1.00)", "2.00 ± 0.00 (2.00, 2.00)"]
    assert written["notes"][-1] == ("Wall time in minutes on a shared 2-core CPU, seed 0: prompts 1.0, sft 21.0, grpo 14.6, "
                                    "total 36.6; seed 1: sft 2.0, grpo 1.0, total 3.0 (prompts done by an earlier command).")
