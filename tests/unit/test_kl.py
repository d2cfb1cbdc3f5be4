"""KL controllers: the fixed one never moves; the adaptive one (Ziegler et al. 2019) moves β towards the target,
at most ±20% per horizon; both states round-trip through JSON."""

from __future__ import annotations

import json

import pytest

from rlhfkit.kl_control import AdaptiveKLController, FixedKLController


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


def test_adaptive_moves_up_when_kl_above_target():
    # KL / target - 1 = 0.1; over half a horizon: β · (1 + 0.1 · ½).
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=6.6, n_steps=5000)
    assert ctl.value == pytest.approx(0.1 * 1.05, abs=1e-12)


def test_adaptive_moves_down_when_kl_below_target():
    # KL / target - 1 = -0.1 over a full horizon: β · 0.9.
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=5.4, n_steps=10000)
    assert ctl.value == pytest.approx(0.09, abs=1e-12)


def test_adaptive_error_is_clipped_to_twenty_percent_per_horizon():
    up = AdaptiveKLController(0.1, target=6.0, horizon=100)
    up.update(current_kl=60.0, n_steps=100)  # error 9 -> clipped to 0.2
    assert up.value == pytest.approx(0.12, abs=1e-12)
    down = AdaptiveKLController(0.1, target=6.0, horizon=100)
    down.update(current_kl=0.0, n_steps=100)  # error -1 -> clipped to -0.2
    assert down.value == pytest.approx(0.08, abs=1e-12)


def test_adaptive_at_target_stays():
    ctl = AdaptiveKLController(0.2, target=3.0, horizon=50)
    ctl.update(current_kl=3.0, n_steps=50)
    assert ctl.value == pytest.approx(0.2, abs=1e-12)


def test_adaptive_argument_checks():
    for kwargs in ({"init_kl_coef": 0.0}, {"target": 0.0}, {"horizon": 0}):
        args = {"init_kl_coef": 0.1, "target": 6.0, "horizon": 100, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            AdaptiveKLController(**args)


@pytest.mark.parametrize("make", [lambda: FixedKLController(0.05), lambda: AdaptiveKLController(0.1, 6.0, 1000)])
def test_state_round_trips_through_json(make):
    ctl = make()
    ctl.update(current_kl=9.0, n_steps=300)
    saved = json.loads(json.dumps(ctl.state_dict()))
    resumed = make()
    resumed.load_state_dict(saved)
    assert resumed.value == ctl.value
    ctl.update(current_kl=2.0, n_steps=300)
    resumed.update(current_kl=2.0, n_steps=300)
    assert resumed.value == ctl.value
