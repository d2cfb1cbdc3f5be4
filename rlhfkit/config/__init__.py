"""Typed, nested run configs: YAML files plus `key.sub=value` overrides, validated once, frozen afterwards.

Every stage has one config class (`SFTConfig`, `RMConfig`, ...) built from the shared `TrainConfig` and a
stage-specific `algo` section. Each field is declared once, with its type, its range (`annotated_types` constraints
such as `Ge(1)`, read by the loader) and its documentation:
    sections.py  the sections every stage shares (model, data, optim, logging, generation, reward, KL), TrainConfig
    stages.py    one config class per stage, with its `algo` options
    fields.py    reading: YAML, overrides, typed coercion with ranges, `load_config`, `config_to_yaml`
Any problem raises `ConfigError` naming the full key (`optim.lr`, `data.train`) before a model is loaded.
"""

from rlhfkit.config.fields import config_to_yaml, load_config, parse_overrides, read_yaml
from rlhfkit.config.sections import (AlarmsConfig, DataConfig, GenerationConfig, KLConfig, LoggingConfig, LoraConfig, ModelConfig,
                                     OptimConfig, QuantizationConfig, RewardConfig, TrainConfig, bitsandbytes_problem)
from rlhfkit.config.stages import (DPOConfig, DPOOptions, EvalConfig, KTOConfig, KTOOptions, OnlineConfig, OnlineDPOConfig,
                                   OnlineDPOOptions, OnlineOptions, ORPOConfig, ORPOOptions, RFTConfig, RFTOptions, RMConfig, RMOptions, SFTConfig,
                                   SFTOptions)

__all__ = [
    "config_to_yaml", "load_config", "parse_overrides", "read_yaml",
    "AlarmsConfig", "DataConfig", "GenerationConfig", "KLConfig", "LoggingConfig", "LoraConfig", "ModelConfig", "OptimConfig",
    "QuantizationConfig", "RewardConfig", "TrainConfig", "bitsandbytes_problem",
    "DPOConfig", "DPOOptions", "EvalConfig", "KTOConfig", "KTOOptions", "OnlineConfig", "OnlineDPOConfig", "OnlineDPOOptions", "OnlineOptions", "ORPOConfig",
    "ORPOOptions", "RFTConfig", "RFTOptions", "RMConfig", "RMOptions", "SFTConfig", "SFTOptions",
]
