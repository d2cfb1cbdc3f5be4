"""The seeds' figures as a sanity check of `rlhfkit plan`: PPO on a Llama-style 7B (4 models of ~14 GB in bf16, plus
optimizer states and the rollout cache: 80-120 GB; LoRA with a 4-bit reference and reward model: 40-60 GB), planned
from a Llama-2-7B config.json written here (no weights), on an H100-80GB.

    python bench/plan_seeds.py    # writes docs/results/plan_seeds.{json,md} through bench/results.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
            "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# A common PPO setting for a 7B model on one GPU: 512-token prompts and responses, 16 prompts a rollout,
# micro-batches of 4, bf16 weights, gradient checkpointing.
BASE = {"model.dtype": "bfloat16", "model.gradient_checkpointing": True, "data.max_prompt_length": 512,
        "data.max_length": 1024, "generation.max_new_tokens": 512, "algo.rollout_batch_size": 16,
        "optim.per_device_batch_size": 4}
CASES = [
    ("full fine-tuning: policy, reference, reward model, critic (all bf16)", "80-120", {}),
    ("LoRA, reward model in 4 bits (the reference is the base, adapters off; critic a second adapter)", "40-60",
     {"model.lora.enabled": True, "reward.quantization.load_in_4bit": True}),
    ("QLoRA: base (so the reference too) and reward model in 4 bits", "40-60",
     {"model.lora.enabled": True, "model.quantization.load_in_4bit": True, "reward.quantization.load_in_4bit": True}),
]


def main() -> None:
    import rlhfkit

    directory = tempfile.mkdtemp(prefix="llama7b-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(LLAMA_7B, f)
    rows = []
    for name, seed, changes in CASES:
        overrides = {**BASE, "model.name_or_path": directory, "reward.model": [directory], **changes}
        plan = rlhfkit.plan("ppo", overrides=overrides, device="H100-80GB")
        phases = {ph.name: {k: round(v / 2**30, 2) for k, v in ph.parts.items()} for ph in plan.phases}
        rows.append({"case": name, "seed_gb": seed, "planned_peak_gb": round(plan.peak_gb, 1), "phases": phases,
                     "fits_h100": plan.fits, "smallest_device": plan.smallest_device,
                     "first_suggestion": plan.suggestions[0].text if plan.suggestions else None})
    from results import record

    notes = ["A Llama-2-7B config.json (no weights), PPO with a 7B reward model that also initialises the critic, "
             + ", ".join(f"`{k}={v}`" for k, v in BASE.items()) + ", one process on an H100-80GB (bf16 mixed "
             "precision)."]
    notes += [f"Per part (GB), {r['case']}: " + "; ".join(
        f"{phase}: " + ", ".join(f"{k} {v}" for k, v in parts.items()) for phase, parts in r["phases"].items())
        for r in rows]
    record("plan_seeds", "rlhfkit plan beside the seeds' figures for PPO on a 7B model",
           ["case", "seed's figure (GB)", "planned peak (GB)", "fits H100-80GB", "smallest device"],
           [[r["case"], r["seed_gb"], r["planned_peak_gb"], "yes" if r["fits_h100"] else "no",
             r["smallest_device"] or "none"] for r in rows], command="python bench/plan_seeds.py", notes=notes)

if __name__ == "__main__":
    main()
