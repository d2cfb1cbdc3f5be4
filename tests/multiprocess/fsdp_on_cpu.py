"""`torchrun --nproc_per_node N fsdp_on_cpu.py ACCELERATE_CONFIG JOBS.json RESULTS_DIR`: driver.py's jobs (rlhfkit CLI
runs) under accelerate's real FSDP path on CPU processes (gloo), with the FSDP settings of an accelerate config file
(configs/accelerate/fsdp.yaml, fsdp2.yaml) as `accelerate launch --config_file` passes them to its processes.

accelerate 1.15 picks FSDP only on GPU-like devices: on CPU processes its state stays MULTI_CPU (DDP). This runner
changes that one decision — it reports the CPU processes as a multi-device type, so `AcceleratorState` turns them
into FSDP, and keeps the device "cpu" — and one setting: FSDP1's `sync_module_states`, whose broadcast needs a device
(every process builds the same weights from the seed here anyway). The rest — the plugin read from the environment,
`prepare` wrapping (FSDP1) or `fully_shard`-ing (FSDP2) the model, the optimizer, `clip_grad_norm_`, torch's
state-dict functions — is accelerate's and torch's own code, run on gloo."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import run_jobs  # noqa: E402


def force_fsdp_on_cpu() -> None:
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.PartialState.__init__

    def patched(self, cpu: bool = False, **kwargs):
        init(self, cpu=cpu, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU  # AcceleratorState then turns it into FSDP
            self.device = torch.device("cpu")  # FSDP1 checks its device_id against the parameters' device

    state.PartialState.__init__ = patched


def launch_env(config_file: str) -> dict[str, str]:
    """The FSDP variables `accelerate launch --config_file CONFIG_FILE` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", config_file, "--num_processes", "2", "x.py"])
    args, _, _ = _validate_launch_command(args)
    env = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}
    env["FSDP_SYNC_MODULE_STATES"] = "false"  # on CPU FSDP1's plugin raises "There are currently no available devices found"
    return env


if __name__ == "__main__":
    os.environ.update(launch_env(sys.argv[1]))
    force_fsdp_on_cpu()
    run_jobs(*sys.argv[2:4])
