"""Peak memory of exporting a LoRA model as merged full weights: peft's merge on a deep copy of the model where it
lies (the export before `models.cpu_copy`) against `models.save_model`, which merges a copy made on the CPU.

Each variant runs in its own subprocess on the same random model with random adapters: the tiny test Llama
(`--size tiny`) or a ~27M-parameter Llama (`--size medium`, the default, large enough for the figures to stand out of
the allocator's noise). Reported per variant: the model's own size, the peak growth of the accelerator's allocated
memory during the export (`torch.cuda.max_memory_allocated`, with CUDA), and the peak growth of the process's
resident set (`resource.getrusage` ru_maxrss) over the RSS just before the export. Both variants write the same
files (tests/unit/test_export.py).

On a CPU both variants make one copy in the same memory, so the figures are alike; the difference is on an
accelerator, where the deep copy adds the whole model to the device and the CPU copy adds none
(tests/unit/test_export.py asserts < 10% of the model on CUDA). The table goes to docs/results/export_memory[_cuda].md.

    python bench/export_memory.py                 # CUDA when available, else CPU
    python bench/export_memory.py --size tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

from results import record

SIZES = {"tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4),
         "medium": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(variant: str, size: str, device: str, workdir: str) -> dict:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.config import LoraConfig, ModelConfig
    from rlhfkit.model_sources import build_tiny_tokenizer
    from rlhfkit.models import load_causal_lm, load_tokenizer, save_model

    base_dir = os.path.join(workdir, "base")
    if not os.path.isdir(base_dir):
        tokenizer = build_tiny_tokenizer()
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, tie_word_embeddings=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                     **SIZES[size])).save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    cfg = ModelConfig(name_or_path=base_dir, lora=LoraConfig(enabled=True, r=16, alpha=32, dropout=0.0))
    tokenizer = load_tokenizer(cfg)
    model = load_causal_lm(cfg, tokenizer).to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.02)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    out = os.path.join(workdir, variant)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start_alloc = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_mb()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if variant == "deepcopy":
        copy.deepcopy(model).merge_and_unload().save_pretrained(out)
    else:
        save_model(model, None, out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"variant": variant, "device": device, "model_mb": round(model_mb, 1),
              # ru_maxrss is the process's peak so far: the export's own peak when it exceeds the load's
              "rss_peak_growth_mb": round(max(peak, peak0) - rss0, 1)}
    if cuda:
        torch.cuda.synchronize()
        result["accelerator_peak_growth_mb"] = round((torch.cuda.max_memory_allocated() - start_alloc) / 2**20, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print(json.dumps(_child(args.child[0], args.size, args.device, args.child[1])))
        return
    rows, labels = [], {"deepcopy": "peft merge on a deep copy of the model where it lies",
                        "cpu_copy": "merge on a CPU copy (`models.cpu_copy`, what rlhfkit does)"}
    with tempfile.TemporaryDirectory() as workdir:
        for variant in ("deepcopy", "cpu_copy"):
            cmd = [sys.executable, __file__, "--size", args.size, "--device", args.device, "--child", variant, workdir]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            print(line)
            r = json.loads(line)
            rows.append([labels[variant], f"{r['rss_peak_growth_mb']:.0f}"]
                        + ([f"{r['accelerator_peak_growth_mb']:.0f}"] if args.device == "cuda" else []))
    record("export_memory" + ("_cuda" if args.device == "cuda" else ""), "Peak memory of a merged LoRA export",
           ["export", "peak RSS growth (MB)"] + (["accelerator peak growth (MB)"] if args.device == "cuda" else []), rows,
           command=f"python bench/export_memory.py --size {args.size} --device {args.device}",
           notes=[f"A random Llama with random adapters ({r['model_mb']:.0f} MB of fp32 weights), each variant in its own "
                  "process; both write the same files."])


if __name__ == "__main__":
    main()
