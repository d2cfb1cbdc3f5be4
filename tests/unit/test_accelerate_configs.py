"""configs/accelerate/*.yaml go through accelerate's own config loader and launch preparation — the steps
`accelerate launch --config_file FILE` takes before it starts any process — and set what their comments promise.
No process starts and no GPU is needed; whether training runs under them is another matter (the table in docs/distributed.md)."""

import glob
import os

import pytest

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, patch_environment
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# file -> (distributed type, num_machines)
CONFIGS = {
    "one_gpu.yaml": ("NO", 1),
    "multi_gpu.yaml": ("MULTI_GPU", 1),
    "multi_node.yaml": ("MULTI_GPU", 2),
    "fsdp.yaml": ("FSDP", 1),
    "fsdp2.yaml": ("FSDP", 1),
    "zero2.yaml": ("DEEPSPEED", 1),
    "zero3.yaml": ("DEEPSPEED", 1),
    "zero3_offload.yaml": ("DEEPSPEED", 1),
}


def test_every_file_is_checked():
    found = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "accelerate", "*.yaml"))}
    assert found == set(CONFIGS)


def launch_args(name):
    """The arguments `accelerate launch --config_file FILE -m rlhfkit.cli sft` would start processes with."""
    path = os.path.join(ROOT, "configs", "accelerate", name)
    args = launch_command_parser().parse_args(["--config_file", path, "-m", "rlhfkit.cli", "sft"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_loads_with_known_keys_only(name):
    config = load_config_from_file(os.path.join(ROOT, "configs", "accelerate", name))  # unknown top-level keys raise
    distributed_type, machines = CONFIGS[name]
    assert config.distributed_type.value == distributed_type and config.num_machines == machines
    assert config.mixed_precision == "no"  # rlhfkit's own mixed_precision key decides (see the files' comments)
    # accelerate copies fsdp_config / deepspeed_config entries onto its launch options without checking their names:
    # a misspelt key would be ignored silently.
    options = set(vars(launch_command_parser().parse_args(["x.py"])))
    for section in (config.fsdp_config, config.deepspeed_config):
        assert set(section) <= options, sorted(set(section) - options)


def test_fsdp_wraps_decoder_layers_and_keeps_original_parameters_for_lora():
    args, _ = launch_args("fsdp.yaml")
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "1"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP" and env["FSDP_USE_ORIG_PARAMS"] == "true"
    assert env["FSDP_RESHARD_AFTER_FORWARD"].upper() == "FULL_SHARD" and env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"


def test_fsdp2_is_version_2_with_a_boolean_reshard():
    args, _ = launch_args("fsdp2.yaml")
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP" and env["FSDP_RESHARD_AFTER_FORWARD"].lower() == "true"


def test_multi_node_has_placeholders_to_fill():
    args, _ = launch_args("multi_node.yaml")
    assert args.num_machines == 2 and args.num_processes == 16 and args.main_process_ip == "MAIN_MACHINE_IP"
    prepare_multi_gpu_env(args)  # sets the torchrun options the launch would pass
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 0)
    endpoint = f"{getattr(args, 'master_addr', '')}:{getattr(args, 'master_port', '')}"
    assert "MAIN_MACHINE_IP:29500" in (endpoint, getattr(args, "rdzv_endpoint", None))


@pytest.mark.parametrize("name, stage, offload", [("zero2.yaml", 2, "none"), ("zero3.yaml", 3, "none"),
                                                  ("zero3_offload.yaml", 3, "cpu")])
def test_deepspeed_plugin_builds(name, stage, offload):
    """DeepSpeedPlugin (built from the launch environment, as in each process) needs no deepspeed installed."""
    args, defaults = launch_args(name)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
    _, env = prepare_deepspeed_cmd_env(args)
    with patch_environment(**env):
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == stage and plugin.gradient_clipping == 1.0
    assert zero["offload_optimizer"]["device"] == offload and zero["offload_param"]["device"] == offload
    assert zero["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)
