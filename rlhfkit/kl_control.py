"""The controllers of the KL coefficient β of KL-regularised RLHF: fixed, and adaptive (Ziegler et al. 2019,
arXiv 1909.08593, §2.2); and Skywork-OR1's controller of the entropy bonus's coefficient. The KL itself (estimators, per-token and per-sequence figures) is `rlhfkit.kl`'s.

Both expose `.value` (the current β), `.update(current_kl, n_steps)` after each rollout batch, and
`state_dict()` / `load_state_dict()` of plain floats (JSON-serialisable, saved with the trainer state so a resumed
run continues with the same β).

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import math


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


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy control (He et al. 2025, arXiv 2505.22312, §3.2.2), with TRL's semantics: the
    coefficient c moves by ±Δ each optimizer step (up while the step's entropy is at or below the target, down
    otherwise, within [c_min, c_max]), and the bonus applies only while the last step's entropy was at or below the
    target. `value` is the coefficient the next step applies. State: a JSON-able dict, saved with the checkpoint."""

    def __init__(self, coef: float, target: float, delta: float, low: float, high: float):
        self.coef, self.target, self.delta, self.low, self.high = float(coef), target, delta, low, high
        self.last_entropy = math.inf  # no step measured yet: no bonus, as TRL starts

    @property
    def value(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose mean token entropy (every process) was `entropy`."""
        step = self.delta if entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, self.low), self.high)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
        self.last_entropy = math.inf if state["last_entropy"] is None else float(state["last_entropy"])
