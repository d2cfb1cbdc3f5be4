"""The controllers of the KL coefficient β of KL-regularised RLHF: fixed, and adaptive (Ziegler et al. 2019,
arXiv 1909.08593, §2.2). The KL itself (estimators, per-token and per-sequence figures) is `rlhfkit.kl`'s.

Both expose `.value` (the current β), `.update(current_kl, n_steps)` after each rollout batch, and
`state_dict()` / `load_state_dict()` of plain floats (JSON-serialisable, saved with the trainer state so a resumed
run continues with the same β).

This module imports nothing beyond the standard library.
"""

from __future__ import annotations


class FixedKLController:
    """β stays at `kl_coef`."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: a fixed β ignores the measured KL."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards `target` (Ziegler et al. 2019, §2.2).

    e = clip(KL / target - 1, -0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).

    The paper writes β ← β(1 + K_β e) with K_β = 0.1; the n_steps / horizon form is its released code's (and TRL's):
    over `horizon` samples β moves by at most ±20%, and the clip keeps one outlier batch from swinging β.

    Args:
        init_kl_coef: initial β > 0.
        target: KL (nats per sequence, as the trainer measures it) to steer to, > 0.
        horizon: number of samples (episodes) over which a full correction is applied, > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not init_kl_coef > 0:
            raise ValueError(f"init_kl_coef must be > 0, got {init_kl_coef}")
        if not target > 0:
            raise ValueError(f"target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β after a batch of `n_steps` samples whose mean KL was `current_kl`."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
