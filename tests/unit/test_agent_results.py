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
