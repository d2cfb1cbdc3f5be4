"""Is liger-kernel's fused linear cross-entropy worth a dependency? Peak memory and time of the token loss computed
from the last hidden states, plain against fused, at the vocabularies our users train (issue 12, item 4: "measure,
then decide").

The plain path is what rlhfkit's trainers do today: logits = h @ Wᵀ in the model's dtype, then log-softmax in fp32
and the labels' log-probs (`rlhfkit.ops.logprobs_from_logits`), mean over tokens, backward into h and W. The fused
path is `liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss`, which never materialises the (N, V) logits.
Both compute the same loss (checked to 1e-2 relative in bf16); forward + backward is timed (median of 10 after 3
warm-ups) and `torch.cuda.max_memory_allocated` above the inputs is reported.

    python bench/liger_ce.py                 # needs CUDA and triton (liger's kernels are triton kernels)
    python bench/liger_ce.py --tokens 4096   # N = batch × sequence tokens

On CPU it says why it cannot run and exits 0 (liger has no CPU kernels); the device script (bench/device.sh) runs it
on a GPU. The table goes to docs/results/liger_ce.json and .md (bench/results.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from results import record

SHAPES = [  # (name, hidden size, vocabulary)
    ("SmolLM2-135M", 576, 49152),
    ("Llama-3-8B", 4096, 128256),
]


def plain_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from rlhfkit.ops import logprobs_from_logits

    logits = h @ weight.T  # (N, V) in the model's dtype
    return -logprobs_from_logits(logits[None], labels[None]).mean()


def measure(fn, h, weight, labels) -> tuple[float, float, torch.Tensor]:
    """(median seconds of forward + backward, peak MiB above the inputs, the loss)."""
    times = []
    for i in range(13):
        h.grad = weight.grad = None
        torch.cuda.synchronize()
        if i == 3:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn(h, weight, labels)
        loss.backward()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20, loss.detach().float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="N, tokens per micro-batch (16 x 512 by default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("liger_ce: needs a CUDA GPU (liger-kernel's kernels are triton kernels); nothing measured here")
        return 0
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        print(f"liger_ce: liger-kernel is not importable ({exc}); carry its wheel (pure Python) and triton")
        return 0
    fused = LigerFusedLinearCrossEntropyLoss()
    rows = []
    print(f"{'shape':<14} {'N':>6} {'V':>7}  {'plain s':>8} {'fused s':>8} {'plain MiB':>10} {'fused MiB':>10}  mem ratio")
    for name, hidden, vocab in SHAPES:
        torch.manual_seed(0)
        h = (torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
        weight = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5).requires_grad_()
        labels = torch.randint(0, vocab, (args.tokens,), device="cuda")
        t_plain, m_plain, l_plain = measure(plain_loss, h, weight, labels)
        t_fused, m_fused, l_fused = measure(lambda a, w, y: fused(w, a, y), h, weight, labels)
        same = torch.allclose(l_plain, l_fused, rtol=1e-2)
        print(f"{name:<14} {args.tokens:>6} {vocab:>7}  {t_plain:>8.4f} {t_fused:>8.4f} {m_plain:>10.0f} {m_fused:>10.0f}"
              f"  {m_plain / max(m_fused, 1e-9):>6.2f}x  loss {float(l_plain):.4f} vs {float(l_fused):.4f}"
              f"{'' if same else '  (DIFFERENT)'}")
        rows.append([name, args.tokens, vocab, f"{t_plain:.4f}", f"{t_fused:.4f}", f"{m_plain:.0f}", f"{m_fused:.0f}",
                     "yes" if same else "NO"])
        del h, weight, labels
        torch.cuda.empty_cache()
    record("liger_ce", "Token loss from the last hidden states: plain against liger's fused linear cross-entropy",
           ["shape", "N", "V", "plain s", "fused s", "plain MiB", "fused MiB", "same loss (1e-2)"], rows,
           command="python " + " ".join(sys.argv),
           notes=["bf16; forward + backward, median of 10 after 3 warm-ups; torch.cuda.max_memory_allocated above the "
                  "inputs."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
