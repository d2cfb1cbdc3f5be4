"""Evaluation: metrics of sampled text, reward-hacking alarms, and the run dashboard and report."""
