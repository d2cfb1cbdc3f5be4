import pytest

from rlhfkit.config import RMConfig, SFTConfig, config_to_yaml, load_config, parse_overrides
from rlhfkit.errors import ConfigError

REQUIRED = ["model.name_or_path=tiny", "data.train=x.jsonl", "output_dir=out"]


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name_or_path: a\ndata:\n  train: t.jsonl\noutput_dir: o\noptim:\n  lr: 0.5\nseed: 3\n")
    cfg = load_config(SFTConfig, str(path), ["optim.lr=1e-4", "model.lora.enabled=true", "logging.report_to=[tensorboard]"])
    assert cfg.optim.lr == pytest.approx(1e-4)  # `1e-4` is a string to YAML 1.1; the typed field takes it as a number
    assert cfg.seed == 3 and cfg.model.name_or_path == "a"
    assert cfg.model.lora.enabled is True
    assert cfg.logging.report_to == ["tensorboard"]


def test_shared_keys_and_defaults():
    cfg = load_config(RMConfig, None, REQUIRED + ["data.eval=e.jsonl", "seed=7", "max_steps=5"])
    assert (cfg.data.eval, cfg.seed, cfg.max_steps, cfg.output_dir) == ("e.jsonl", 7, 5, "out")
    assert cfg.algo.center_coef == 0.0


def test_config_is_frozen():
    cfg = load_config(SFTConfig, None, REQUIRED)
    with pytest.raises(Exception):
        cfg.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("optim.lr=fast", "config key 'optim.lr': expected a number, got 'fast'"),
        ("seed=1.5", "config key 'seed': expected an integer, got 1.5"),
        ("model.lora.enabled=3", "config key 'model.lora.enabled': expected true/false, got 3"),
        ("model.dtype=fp8", "config key 'model.dtype': expected one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp8'"),
        ("data.max_prompt_length=4096", "config key 'data.max_prompt_length' must be in [1, max_length=1024)"),
        ("optim.per_device_batch_size=0", "config key 'optim.per_device_batch_size' must be >= 1, got 0"),
        ("max_steps=0", "config key 'max_steps' must be >= 1 or -1"),
        ("optim=3", "config key 'optim': expected a mapping of OptimConfig fields, got 3"),
        ("optim.lr", "override 'optim.lr': expected key.sub=value"),
    ],
)
def test_bad_keys_and_types_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, REQUIRED + [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_required_keys():
    with pytest.raises(ConfigError, match="config key 'model.name_or_path' is required"):
        load_config(SFTConfig, None, ["data.train=x", "output_dir=o"])


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' not found"):
        load_config(SFTConfig, str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' line \d+: not valid YAML"):
        load_config(SFTConfig, str(bad))


def test_overrides_nest_and_parse_values():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]", "e="]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2], "e": ""}


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(SFTConfig, None, REQUIRED + ["optim.lr=3e-4"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(SFTConfig, str(path)) == cfg
