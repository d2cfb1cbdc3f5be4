"""A rollout's scoring forwards compute the logits of its response's positions only (`forwards.response_logits`),
whatever its prompts' lengths, and no scoring forward builds a KV cache: the log-probs, entropies and gradients are
those of each row run alone, unpadded; the live tensors hold B·R·V logits, not a window from the shortest prompt's
end; and the planner counts what is held."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

from rlhfkit.config import ModelConfig
from rlhfkit.config.sections import LoraConfig
from rlhfkit.forwards import response_logits
from rlhfkit.models import load_causal_lm, rollout_logprobs, token_logprobs
from rlhfkit.plan.measure import LiveTensors
from rlhfkit.types import Rollout

TAU = 0.7


def rollout(prompt_lengths, response_lengths, p: int, r: int, vocab: int = 100, seed: int = 0) -> Rollout:
    """Left-padded prompts of the given lengths in a width of `p`, right-padded responses in a width of `r`."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lengths)
    prompt_mask = torch.tensor([[0] * (p - n) + [1] * n for n in prompt_lengths])
    response_mask = torch.tensor([[1] * n + [0] * (r - n) for n in response_lengths])
    return Rollout(prompt_ids=torch.randint(3, vocab, (b, p), generator=g) * prompt_mask, prompt_mask=prompt_mask,
                   response_ids=torch.randint(3, vocab, (b, r), generator=g) * response_mask,
                   response_mask=response_mask, group_ids=torch.arange(b), has_eos=torch.ones(b, dtype=torch.bool),
                   sampler_logprobs=torch.zeros(b, r), action_mask=response_mask)


def alone(model, ro: Rollout):
    """The oracle: each row's real tokens run alone, unpadded, through the model's plain forward; the log-probs and
    entropies (at TAU) of its response tokens, 0 on padding: ((B, R), (B, R))."""
    logprobs, entropies = torch.zeros(ro.response_ids.shape), torch.zeros(ro.response_ids.shape)
    for i in range(ro.response_ids.shape[0]):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i] == 1]
        response = ro.response_ids[i][ro.response_mask[i] == 1]
        logits = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0].float() / TAU
        z = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # (n, V): position P-1+k predicts response token k
        n = len(response)
        logprobs[i, :n] = z.gather(-1, response[:, None])[:, 0]
        entropies[i, :n] = -(z.exp() * z).sum(-1)
    return logprobs, entropies


def lm(kind: str, lora: bool = False):
    torch.manual_seed(0)
    if kind == "llama":
        return load_causal_lm(ModelConfig(name_or_path="tiny", lora=LoraConfig(enabled=lora, r=4, dropout=0.0)))
    small = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, pad_token_id=0)
    if kind == "gemma2":  # final logits soft-capped at 2 (tanh): far from linear at these logits' scale
        return Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=2.0, sliding_window=64))
    return GraniteForCausalLM(GraniteConfig(**small, logits_scaling=3.0))  # logits divided by 3


# Prompts of 2 to 24 tokens in a width of 24: the shortest prompt's end is 22 positions before the longest's.
MIXED = dict(prompt_lengths=[24, 2, 13, 5], response_lengths=[8, 5, 8, 1], p=24, r=8)


@pytest.mark.parametrize("kind,lora", [("llama", False), ("llama", True), ("gemma2", False), ("granite", False)],
                         ids=["tiny", "tiny-lora", "gemma2-softcap", "granite-scaled"])
def test_rollout_logprobs_and_gradients_are_each_rows_own(kind, lora):
    """Log-probs, entropies and the parameters' gradients of `rollout_logprobs` on prompts of very different lengths
    equal those of each row run alone (a tied head, Gemma2's soft-capping and Granite's scaling included)."""
    model = lm(kind, lora)
    if lora:  # LoRA's B starts at zero: give the adapters a value so that they change the log-probs
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    ro = rollout(**MIXED)
    weights = torch.randn(ro.response_ids.shape, generator=torch.Generator().manual_seed(2))
    trained = [p for p in model.parameters() if p.requires_grad]

    logprobs, entropy = rollout_logprobs(model, ro, TAU, with_entropy=True)
    got = torch.autograd.grad((logprobs * weights).sum() + entropy.sum(), trained)
    want_logprobs, want_entropy = alone(model, ro)
    want = torch.autograd.grad((want_logprobs * weights).sum() + want_entropy.sum(), trained)

    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)
    assert (logprobs[ro.response_mask == 0] == 0).all() and (entropy[ro.response_mask == 0] == 0).all()
    for g, w in zip(got, want):  # sums over the tokens in another order: equal to float32's rounding
        assert (g - w).norm() <= 1e-5 * w.norm(), ((g - w).norm(), w.norm())


def test_a_model_whose_head_is_not_its_output_embedding_gives_the_same_values():
    """The rule's other side: a forward that never calls the module `get_output_embeddings()` names (here a wrapper
    without one) gets its own logits gathered after it: the same values."""

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    model = lm("llama")
    ro = rollout(**MIXED)
    with torch.no_grad():
        torch.testing.assert_close(rollout_logprobs(Wrapped(model), ro, TAU), alone(model, ro)[0], rtol=1e-6, atol=1e-6)


class Widest(LiveTensors):
    """The tracker, noting the largest tensor it saw whose last dimension is `width` (the vocabulary)."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.widest = width, 0

    def add(self, *tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width:
                self.widest = max(self.widest, t.numel())
        super().add(*tensors)


def scoring_peak(model, ro: Rollout, vocab: int, grad: bool) -> tuple[int, int]:
    """(the live bytes a rollout's scoring forward adds at its peak (with `grad`: and its backward), the largest
    vocabulary-wide tensor's elements)."""
    tracker = Widest(vocab)
    tracker.add_module(model)
    with tracker, torch.set_grad_enabled(grad):
        base = tracker.current
        tracker.reset_peak()
        logprobs = rollout_logprobs(model, ro, TAU)
        if grad:
            logprobs.sum().backward()
        return tracker.peak - base, tracker.widest


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_rollout_forward_holds_the_logits_of_its_response_only(grad):
    """4 rows of 16 new tokens after prompts of 2 to 96 tokens: the widest vocabulary-wide tensor is the B·R·V
    logits (4 · 16 · 103), not a window from the shortest prompt's end (4 · 110 · 103), and the forward's peak is that
    of the same rollout with every prompt full, where no window is wider than the response."""
    model = lm("llama")
    model.zero_grad(set_to_none=True)
    vocab = model.config.vocab_size
    mixed = rollout([96, 2, 50, 96], [16, 16, 9, 16], p=96, r=16)
    full = rollout([96, 96, 96, 96], [16, 16, 9, 16], p=96, r=16)
    peak, widest = scoring_peak(model, mixed, vocab, grad)
    model.zero_grad(set_to_none=True)
    same, _ = scoring_peak(model, full, vocab, grad)
    assert widest == 4 * 16 * 103 == 4 * 16 * vocab
    assert abs(peak - same) <= 0.02 * same, (peak, same)


def test_a_masked_no_grad_forward_builds_no_kv_cache():
    """A reference's forward of left-padded rows (a mask is kept) under no_grad: with a KV cache every layer's keys
    and values would stay alive to the forward's end (2 · B · kv_heads · T · head_dim fp32 per layer); without one
    the peak grows by at most a hidden state (B · T · hidden fp32) a layer."""
    b, t = 4, 128
    ids = torch.randint(3, 100, (b, t), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :90] = 0
    mask[3, :7] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : t // 2] = -100
    peaks = []
    for layers in (1, 2):
        model = load_causal_lm(ModelConfig(name_or_path="tiny", num_layers=layers), trainable=False)
        assert model.config.use_cache  # a frozen model keeps transformers' default
        tracker = LiveTensors()
        tracker.add_module(model)
        with tracker, torch.no_grad():
            base = tracker.current
            tracker.reset_peak()
            token_logprobs(model, ids, mask, labels, TAU)
            peaks.append(tracker.peak - base)
    cache_layer = 2 * b * 2 * t * 16 * 4  # keys and values of one layer: (B, kv_heads, T, head_dim) fp32 each
    assert peaks[1] - peaks[0] <= b * t * 64 * 4 < b * t * 64 * 4 + cache_layer, peaks


def test_the_planned_rollout_logits_are_the_live_ones():
    """The planner's rollout forwards (π_old, π_ref, the update) take logits over the response only: B·R·V in the
    compute dtype plus one fp32 row without gradient, from the (B, R, V) `response_logits` actually returns."""
    from rlhfkit.plan.layout import layout_of
    from rlhfkit.plan.memory import Precision, logits_bytes
    from rlhfkit.plan.shape import load_shape
    from tests.unit.test_plan_sizes import grpo_config

    prompt, new = 24, 8
    lay = layout_of("grpo", grpo_config(lora=False, rows=4, prompt=prompt, new=new))
    assert lay.trained.logit_len == new and all(f.logit_len in (0, new) for f in lay.frozen)
    rows, shape = lay.frozen[0].rows, load_shape("tiny", "model")  # a micro-batch of 2 rows
    with torch.no_grad():
        logits = response_logits(lm("llama"), rollout([24, 3], [8, 2], p=prompt, r=new))
    assert logits.shape == (rows, new, shape.vocab) == (2, 8, 103)
    planned = logits_bytes(shape, lay.frozen[0], Precision(4, 4, 4))
    assert planned == logits.numel() * 4 + new * shape.vocab * 8
