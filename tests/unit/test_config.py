import pytest

from rlhfkit.config import (DPOConfig, EvalConfig, KTOConfig, OnlineConfig, ORPOConfig, RFTConfig, RMConfig, SFTConfig,
                            config_to_yaml, load_config, parse_overrides)
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
        # Non-finite numbers are refused in every float field, by the loader, naming the dotted key.
        ("optim.lr=.nan", "config key 'optim.lr': expected a finite number, got nan"),
        ("num_epochs=.inf", "config key 'num_epochs': expected a finite number, got inf"),
        ("optim.max_grad_norm=.nan", "config key 'optim.max_grad_norm': expected a finite number, got nan"),
        ("optim.adam_betas=[0.9, .nan]", "config key 'optim.adam_betas[1]': expected a finite number, got nan"),
        ("optim.weight_decay=-.inf", "config key 'optim.weight_decay': expected a finite number, got -inf"),
        ("data.eval_fraction=1e999", "config key 'data.eval_fraction': expected a finite number, got '1e999'"),
        ("model.lora.dropout=.NaN", "config key 'model.lora.dropout': expected a finite number, got nan"),
        # Range checks.
        ("seed=-1", "config key 'seed' must be in [0, 2**32), got -1"),
        ("seed=4294967296", "config key 'seed' must be in [0, 2**32), got 4294967296"),
        ("optim.weight_decay=-0.1", "config key 'optim.weight_decay' must be >= 0, got -0.1"),
        ("optim.adam_eps=0", "config key 'optim.adam_eps' must be > 0, got 0.0"),
        ("model.lora.alpha=0", "config key 'model.lora.alpha' must be >= 1, got 0"),
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


@pytest.mark.parametrize(
    "cls, override, message",
    [
        (RMConfig, "algo.margin_scale=-1", "config key 'algo.margin_scale' must be >= 0, got -1.0"),
        (OnlineConfig, "generation.top_k=-1", "config key 'generation.top_k' must be >= 0 (0 = off), got -1"),
        (OnlineConfig, "algo.gamma=1.5", "config key 'algo.gamma' must be in [0, 1], got 1.5"),
        (OnlineConfig, "algo.lam=-0.1", "config key 'algo.lam' must be in [0, 1], got -0.1"),
        (OnlineConfig, "algo.vf_coef=-1", "config key 'algo.vf_coef' must be >= 0, got -1.0"),
        (OnlineConfig, "algo.clip_eps_high=0", "config key 'algo.clip_eps_high' must be > 0 or null, got 0.0"),
        (OnlineConfig, "algo.clip_range_value=-0.2", "config key 'algo.clip_range_value' must be > 0 or null, got -0.2"),
        (OnlineConfig, "algo.target_kl=0", "config key 'algo.target_kl' must be > 0 or null, got 0.0"),
        (OnlineConfig, "kl.coef=.inf", "config key 'kl.coef': expected a finite number, got inf"),
        (OnlineConfig, "reward.clip=.nan", "config key 'reward.clip': expected a finite number, got nan"),
        (EvalConfig, "seed=-3", "config key 'seed' must be in [0, 2**32), got -3"),
        (OnlineConfig, "algo.allow_new_value_head=true", "config key 'algo.allow_new_value_head' applies only with algo.value_model"),
        # Each kind of range declared beside a field (`annotated_types`), enforced by the loader with the dotted key.
        (SFTConfig, "optim.grad_accum_steps=0", "config key 'optim.grad_accum_steps' must be >= 1, got 0"),  # Ge, int
        (SFTConfig, "optim.lr=-1e-3", "config key 'optim.lr' must be >= 0, got -0.001"),  # Ge, float
        (OnlineConfig, "generation.temperature=0", "config key 'generation.temperature' must be > 0, got 0.0"),  # Gt
        (SFTConfig, "data.eval_fraction=1", "config key 'data.eval_fraction' must be in [0, 1), got 1.0"),  # Interval [)
        (OnlineConfig, "algo.clip_eps=1", "config key 'algo.clip_eps' must be in (0, 1), got 1.0"),  # Interval ()
        (OnlineConfig, "algo.gamma=-0.5", "config key 'algo.gamma' must be in [0, 1], got -0.5"),  # Interval []
        (OnlineConfig, "generation.top_p=0", "config key 'generation.top_p' must be in (0, 1] (1.0 = off), got 0.0"),  # + doc note
        (OnlineConfig, "algo.dual_clip=1", "config key 'algo.dual_clip' must be > 1 or null, got 1.0"),  # optional
        (SFTConfig, "data.max_samples=0", "config key 'data.max_samples' must be >= 1 or null, got 0"),  # optional int
        (OnlineConfig, "reward.missing_eos_penalty=-1", "config key 'reward.missing_eos_penalty' must be >= 0 or null "
                                                        "(subtracted, as in TRL, from the score of a response cut"),
        (SFTConfig, "optim.adam_betas=[0.9]", "config key 'optim.adam_betas' must have 2 items, got [0.9]"),  # Len
        (SFTConfig, "optim.adam_betas=[0.9, 1]", "config key 'optim.adam_betas[1]' must be in [0, 1), got 1.0"),  # list item
        (SFTConfig, "model.lora.dropout=1", "config key 'model.lora.dropout' must be in [0, 1), got 1.0"),  # nested section
        (OnlineConfig, "kl.horizon=0", "config key 'kl.horizon' must be >= 1, got 0"),
        (EvalConfig, "max_prompts=0", "config key 'max_prompts' must be >= 1 or null, got 0"),
    ],
)
def test_out_of_range_numbers_name_the_key(cls, override, message):
    required = {EvalConfig: ["model.name_or_path=tiny", "data.eval=e.jsonl", "output_dir=o"],
                OnlineConfig: REQUIRED + ["reward.function=m:f"]}.get(cls, REQUIRED)
    with pytest.raises(ConfigError) as err:
        load_config(cls, None, required + [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_finite_numbers_still_load():
    cfg = load_config(OnlineConfig, None, REQUIRED + ["reward.function=m:f", "optim.lr=1e-4", "seed=0", "optim.max_grad_norm=null",
                                                      "algo.gamma=1", "algo.lam=0", "generation.top_k=0"])
    assert (cfg.optim.lr, cfg.seed, cfg.optim.max_grad_norm, cfg.algo.gamma) == (1e-4, 0, None, 1.0)


def test_config_file_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  name_or_path: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, str(path))
    assert f"config file '{path}'" in str(err.value) and "UTF-8" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, line, key",
    [
        ("seed: 1\noutput_dir: o\nseed: 2\n", 3, "seed"),
        ("optim:\n  lr: 0.1\n  warmup_steps: 2\n  lr: 0.2\n", 4, "optim.lr"),
        ("optim:\n  lr: 0.1\nseed: 1\noptim:\n  warmup_steps: 2\n", 4, "optim"),
    ],
)
def test_duplicate_yaml_keys_name_file_line_and_key(tmp_path, text, line, key):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, str(path))
    assert f"config file '{path}' line {line}: duplicate key '{key}'" in str(err.value)
    assert "\n" not in str(err.value)


def _ranged_fields(cls, prefix=""):
    """(dotted key, a value just outside one declared bound) for every bound of every field under `cls`."""
    import dataclasses
    import typing

    from annotated_types import Ge, Gt, Interval, Le, Lt

    outside = {Ge: lambda b, t: b - (1 if t is int else 0.5), Gt: lambda b, t: b, Lt: lambda b, t: b,
               Le: lambda b, t: b + (1 if t is int else 0.5)}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        if dataclasses.is_dataclass(tp):
            yield from _ranged_fields(tp, f"{prefix}{name}.")
        arms = [tp] if typing.get_origin(tp) is typing.Annotated else typing.get_args(tp)  # itself, or inside `X | None`
        for base, *meta in (typing.get_args(a) for a in arms if typing.get_origin(a) is typing.Annotated):
            for c in meta:
                for b in list(c) if isinstance(c, Interval) else [c] if type(c) in outside else []:
                    yield f"{prefix}{name}", outside[type(b)](dataclasses.astuple(b)[0], base)


@pytest.mark.parametrize("cls", [SFTConfig, RMConfig, DPOConfig, ORPOConfig, KTOConfig, OnlineConfig, RFTConfig, EvalConfig])
def test_every_declared_range_is_enforced_with_the_dotted_key(cls):
    required = {EvalConfig: ["model.name_or_path=tiny", "data.eval=e.jsonl", "output_dir=o"],
                OnlineConfig: REQUIRED + ["reward.function=m:f"], RFTConfig: REQUIRED + ["reward.function=m:f"]}.get(cls, REQUIRED)
    cases = list(_ranged_fields(cls))
    assert len(cases) > 10
    for key, value in cases:
        with pytest.raises(ConfigError) as err:
            load_config(cls, None, required + [f"{key}={value}"])
        assert str(err.value).startswith(f"config key '{key}' must "), (key, value, str(err.value))


def test_eval_refuses_training_only_fields_of_shared_sections():
    required = ["model.name_or_path=tiny", "data.eval=e.jsonl", "output_dir=o"]
    for override, key in [("data.train=t.jsonl", "data.train"), ("reward.normalize=batch", "reward.normalize"),
                          ("generation.seed_per_prompt=true", "generation.seed_per_prompt")]:
        with pytest.raises(ConfigError, match=f"config key '{key}' is not used by eval"):
            load_config(EvalConfig, None, required + [override])
    cfg = load_config(EvalConfig, None, required + ["reward.model=[rm]", "reward.function=m:f"])  # both are judges
    assert cfg.reward.model == ["rm"] and cfg.data.eval == "e.jsonl"


def test_seed_per_prompt_is_refused_where_each_batch_already_has_its_seed():
    """rft and eval draw each batch under its own seed already: the online stages' per-prompt seeding is refused."""
    with pytest.raises(ConfigError, match="config key 'generation.seed_per_prompt' is not used by rft"):
        load_config(RFTConfig, None, REQUIRED + ["reward.function=m:f", "generation.seed_per_prompt=true"])
    assert load_config(OnlineConfig, None, REQUIRED + ["reward.function=m:f", "generation.seed_per_prompt=true"]) \
        .generation.seed_per_prompt


def test_data_columns_map_canonical_fields_to_dataset_columns():
    cfg = load_config(SFTConfig, overrides=REQUIRED + ["data.columns.prompt=question", "data.columns.completion=answer",
                                                       "data.subset=main"])
    assert cfg.data.columns == {"prompt": "question", "completion": "answer"} and cfg.data.subset == "main"
    assert load_config(SFTConfig, overrides=REQUIRED).data.columns == {}
    with pytest.raises(ConfigError, match=r"^config key 'data\.columns\.question' is not a record field: give "
                                          r"data\.columns\.<field>=<column>, field one of "):
        load_config(SFTConfig, overrides=REQUIRED + ["data.columns.question=prompt"])
    with pytest.raises(ConfigError, match=r"^config key 'data\.columns\.completion': expected a string, got 3$"):
        load_config(SFTConfig, overrides=REQUIRED + ["data.columns.completion=3"])
    with pytest.raises(ConfigError, match=r"^config key 'data\.columns' renames column 'q' twice \(to chosen and prompt\)$"):
        load_config(DPOConfig, overrides=REQUIRED + ["data.columns.prompt=q", "data.columns.chosen=q"])
    with pytest.raises(ConfigError, match=r"^config key 'data\.columns': expected a mapping of a string to a "
                                          r"string, got 'prompt'$"):
        load_config(SFTConfig, overrides=REQUIRED + ["data.columns=prompt"])
