"""Evaluation: metrics of sampled text, reward-hacking alarms, the `rlhfkit eval` stage, and the run dashboard and report.

`metrics` and `alarms` are pure (torch only); `evaluate` loads and samples models; `dashboard` and `report` draw runs.
"""

from rlhfkit.evaluation.alarms import Alarm, AlarmThresholds, SampleStats, check_alarms
from rlhfkit.evaluation.metrics import (
    best_of_n_kl, distinct_n, empty_rate, eos_rate, mean_length, pearson, reward_model_accuracy, sequence_kl,
    truncation_rate, win_rate,
)

__all__ = [
    "Alarm", "AlarmThresholds", "SampleStats", "check_alarms", "best_of_n_kl", "distinct_n", "empty_rate", "eos_rate",
    "mean_length", "pearson", "reward_model_accuracy", "sequence_kl", "truncation_rate", "win_rate",
]
