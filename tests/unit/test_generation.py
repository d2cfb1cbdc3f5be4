"""generate(): rlhfkit's decode loop against transformers' `generate` (same tokens under the same seed, greedy, early
EOS, left padding, the static-cache and compiled paths), the sampled distribution (a χ² test), and the sampler's
log-probs, read one step at a time (no (B, R, V) logits kept)."""

import math

import pytest
import torch

import rlhfkit.generation.session as session_module
from rlhfkit.config import GenerationConfig, ModelConfig
from rlhfkit.generation import decode, generate, truncate_logits
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.types import PromptBatch


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(name_or_path="tiny")
    tok = load_tokenizer(cfg)
    return load_causal_lm(cfg, tok).eval(), tok


def prompts(tok):
    ids = [tok("hello there", add_special_tokens=False)["input_ids"], tok("a b", add_special_tokens=False)["input_ids"]]
    width = max(map(len, ids))
    pad = tok.pad_token_id
    return PromptBatch(torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
                       torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampler_logprobs_equal_the_full_logits_computation(tiny, top_k):
    """Same seed, same tokens: the recorded log-probs equal log_softmax(raw logits / τ) of the sampled tokens computed
    from transformers' `output_logits` (top-k truncation is not part of the density)."""
    model, tok = tiny
    params = GenerationConfig(max_new_tokens=12, temperature=0.7, num_samples=3, top_k=top_k)
    batch = prompts(tok)
    torch.manual_seed(0)
    ro = generate(model, batch, params, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    out = model.generate(input_ids=batch.input_ids.repeat_interleave(3, 0),
                         attention_mask=batch.attention_mask.repeat_interleave(3, 0), do_sample=True, temperature=0.7,
                         top_k=top_k or None, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True)
    sampled = out.sequences[:, batch.input_ids.shape[1]:]
    assert torch.equal(ro.response_ids, sampled.masked_fill(ro.response_mask == 0, tok.pad_token_id))
    full = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ro.sampler_logprobs, full * ro.response_mask, rtol=1e-5, atol=1e-6)
    assert (ro.sampler_logprobs * ro.response_mask).abs().sum() > 0


def test_hf_engine_keeps_no_full_logits(tiny, monkeypatch):
    model, tok = tiny
    seen = {}
    real = model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    generate(model, prompts(tok), GenerationConfig(max_new_tokens=4, engine="hf"), tok.eos_token_id, tok.pad_token_id)
    assert seen and not seen.get("output_logits") and not seen.get("output_scores")


def test_decode_loop_computes_the_last_position_logits_only(tiny, monkeypatch):
    """Every forward of the loop asks for one position's logits, and transformers' `generate` is never called."""
    model, tok = tiny
    calls = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(kw.get("logits_to_keep")) or real(*a, **kw))
    monkeypatch.setattr(model, "generate", lambda **kw: pytest.fail("transformers' generate was called"))
    ro = generate(model, prompts(tok), GenerationConfig(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id)
    assert calls == [1] * ro.response_ids.shape[1]  # a prefill, then one step per further token


def both_engines(model, tok, batch, seed=0, eos=None, eager_static=False, **params):
    """(rlhfkit's rollout, transformers' rollout) drawn under the same seed."""
    eos = tok.eos_token_id if eos is None else eos
    out = []
    for engine, compile_ in (("rlhfkit", eager_static), ("hf", False)):
        torch.manual_seed(seed)
        out.append(generate(model, batch, GenerationConfig(engine=engine, compile=compile_, **params), eos, tok.pad_token_id))
    return out


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("params", [dict(), dict(top_k=5), dict(top_p=0.8, temperature=0.7), dict(num_samples=3, temperature=1.3)])
def test_same_seed_same_tokens_as_transformers_generate(tiny, monkeypatch, static, params):
    """Left-padded prompts of different lengths: the same tokens and log-probs as transformers' `generate`, with and
    without truncation, through the dynamic and the static KV cache."""
    model, tok = tiny
    if static:
        monkeypatch.setattr(session_module, "compiled_step", lambda model, forward, cuda: forward)
    ours, ref = both_engines(model, tok, prompts(tok), eager_static=static, max_new_tokens=12, **params)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert torch.equal(ours.response_mask, ref.response_mask)
    torch.testing.assert_close(ours.sampler_logprobs, ref.sampler_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_equals_transformers_greedy_generate(tiny, monkeypatch, static):
    """top_k=1 is greedy decoding: the tokens of transformers' `generate(do_sample=False)`."""
    model, tok = tiny
    if static:
        monkeypatch.setattr(session_module, "compiled_step", lambda model, forward, cuda: forward)
    batch = prompts(tok)
    torch.manual_seed(3)
    ours = generate(model, batch, GenerationConfig(max_new_tokens=10, top_k=1, compile=static), tok.eos_token_id,
                    tok.pad_token_id)
    greedy = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                            max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(ours.response_ids, greedy[:, batch.input_ids.shape[1]:])


def test_early_eos_stops_each_row_and_the_loop(tiny):
    """With the commonest token as EOS, rows finish at different steps: each is padded after its EOS, and the loop
    stops when the last row finishes (short of max_new_tokens); all of it as transformers does."""
    model, tok = tiny
    batch = prompts(tok)
    torch.manual_seed(0)
    free = generate(model, batch, GenerationConfig(max_new_tokens=30, num_samples=4), tok.eos_token_id, tok.pad_token_id)
    eos = int(free.response_ids.flatten().mode().values)
    ours, ref = both_engines(model, tok, batch, eos=eos, max_new_tokens=250, num_samples=4)
    assert torch.equal(ours.response_ids, ref.response_ids) and torch.equal(ours.has_eos, ref.has_eos)
    lengths = ours.response_mask.sum(1)
    assert ours.has_eos.all() and len(set(lengths.tolist())) > 1, lengths
    assert ours.response_ids.shape[1] == int(lengths.max()) < 250
    after = torch.arange(ours.response_ids.shape[1]) >= lengths[:, None]
    assert after.any() and (ours.response_ids[after] == tok.pad_token_id).all() and (ours.sampler_logprobs[after] == 0).all()


def test_compiled_step_gives_the_same_tokens(tiny):
    """`generation.compile` for real (torch.compile of the one-token step over a StaticCache; inductor on CPU, where
    a GPU would add CUDA graphs): the same tokens as transformers' `generate`."""
    model, tok = tiny
    ours, ref = both_engines(model, tok, prompts(tok), eager_static=True, max_new_tokens=6, num_samples=2)
    assert torch.equal(ours.response_ids, ref.response_ids)
    torch.testing.assert_close(ours.sampler_logprobs, ref.sampler_logprobs, rtol=1e-4, atol=1e-4)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The χ² quantile at 1 - 0.001 (z = 3.09) by the Wilson–Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's χ² of `counts` against `probs`, bins with an expected count under 5 pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.5, top_k=8), dict(top_p=0.6)])
def test_sampled_tokens_follow_the_configured_distribution(tiny, params):
    """8000 first tokens of one prompt (a 103-token vocabulary) against softmax(truncate(logits / τ)): χ² under the
    0.999 quantile, and far over it against the untempered, untruncated distribution (the test can tell them apart).
    Truncated tokens are never drawn. The final norm is scaled by 8 so the random model's logits are far from flat."""
    import copy

    model, tok = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    cfg = GenerationConfig(max_new_tokens=1, **params)
    ids = torch.tensor([tok("hello there", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    target = truncate_logits((logits / cfg.temperature)[None], cfg.top_k, cfg.top_p)[0].softmax(-1)
    torch.manual_seed(0)
    n = 8000
    cfg = GenerationConfig(max_new_tokens=1, num_samples=n, **params)
    tokens, logprobs, *_ = decode(model, PromptBatch(ids, torch.ones_like(ids)), cfg, tok.eos_token_id, tok.pad_token_id)
    counts = torch.bincount(tokens[:, 0], minlength=logits.shape[0]).float()
    assert counts[target == 0].sum() == 0
    stat, df = chi2(counts, target)
    assert stat < chi2_critical(df), (stat, df)
    wrong, wrong_df = chi2(counts, logits.softmax(-1))
    assert wrong > 10 * chi2_critical(wrong_df)
    # The recorded log-prob is the untruncated tempered density of the drawn token.
    torch.testing.assert_close(logprobs[:, 0], torch.log_softmax(logits / cfg.temperature, -1)[tokens[:, 0]])


@pytest.mark.parametrize("params", [dict(), dict(top_k=5), dict(top_p=0.8, temperature=0.7)])
@pytest.mark.parametrize("vocab", [103, 49152])
def test_slot_draws_are_torch_multinomials(params, vocab):
    """`sample_slots` on a CPU computes torch.multinomial's exponentials itself, for the slots present only: under
    each seed every present row's token is the one torch.multinomial draws over all 7 slots (the absent slots' rows
    flat, as the engine drew them before), bit for bit, and the generator is left where multinomial leaves it."""
    from rlhfkit.generation.sampling import sample_slots

    cfg, slots = GenerationConfig(**params), [0, 2, 3, 5]
    data = torch.Generator().manual_seed(vocab)
    for seed in range(12):
        logits = torch.randn(len(slots), vocab, generator=data) * 4
        full = torch.zeros(7, vocab)
        full[slots] = logits
        reference = torch.Generator().manual_seed(seed)
        probs = truncate_logits(full / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
        expected = torch.multinomial(probs, 1, generator=reference).squeeze(-1)[slots]
        ours = torch.Generator().manual_seed(seed)
        token, logprob = sample_slots(logits, slots, 7, cfg, ours)
        assert torch.equal(token, expected)
        assert torch.equal(torch.rand(3, generator=ours), torch.rand(3, generator=reference))
        torch.testing.assert_close(logprob, torch.log_softmax(logits / cfg.temperature, -1).gather(-1, token[:, None])[:, 0])
    with pytest.raises(RuntimeError, match="inf.*nan"):  # what is_nonfinite_sampling recognises
        sample_slots(torch.full((2, vocab), float("nan")), None, 2, cfg)


def test_truncate_logits_by_hand():
    """Scores [3, 2, 1, 0]: top-2 keeps {0, 1}; probabilities ≈ [.644, .237, .087, .032], so top_p 0.85 keeps the
    first two (0.881 ≥ 0.85) and top_p 0.5 keeps the first alone."""
    s = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    inf = math.inf
    assert truncate_logits(s, 2, 1.0).tolist() == [[3.0, 2.0, -inf, -inf]]
    assert truncate_logits(s, 0, 0.85).tolist() == [[3.0, 2.0, -inf, -inf]]
    assert truncate_logits(s, 0, 0.5).tolist() == [[3.0, -inf, -inf, -inf]]
    assert truncate_logits(s, 0, 1.0).tolist() == s.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run by bench/device_gen.sh)")
def test_cuda_graph_decode_gives_the_same_tokens_on_a_gpu(tiny):
    """`generation.compile` on a GPU: the static cache, torch.compile(mode="reduce-overhead") and one graph replay per
    token. Greedy (top_k=1) it gives transformers' greedy tokens; sampled, the same tokens as transformers' `generate`
    under one seed (fp32), across two calls (the second replays the graphs the first recorded), with early EOS."""
    model, tok = tiny
    model = model.to("cuda")
    batch = prompts(tok).to("cuda")
    greedy = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                            max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for _ in range(2):
        ours = generate(model, batch, GenerationConfig(max_new_tokens=10, top_k=1, compile=True), tok.eos_token_id,
                        tok.pad_token_id)
        assert torch.equal(ours.response_ids, greedy[:, batch.input_ids.shape[1]:])
    for seed in range(2):
        ours, ref = both_engines(model, tok, batch, seed=seed, eager_static=True, max_new_tokens=40, num_samples=4, eos=2)
        assert torch.equal(ours.response_ids, ref.response_ids)
        torch.testing.assert_close(ours.sampler_logprobs, ref.sampler_logprobs, rtol=1e-4, atol=1e-4)


def test_each_model_keeps_its_compiled_step(tiny, monkeypatch):
    """Policy and reference alternating (an evaluation samples both) compile once each, not once per call."""
    import copy

    tiny_model, tok = tiny
    policy, reference = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    for m in (policy, reference):  # copies of the shared fixture: without a step an earlier test compiled on it
        m.__dict__.pop("_rlhfkit_decode_step", None)
    compiled = []
    monkeypatch.setattr(session_module.torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    params = GenerationConfig(max_new_tokens=3, compile=True)
    for m in (policy, reference, policy, reference):
        generate(m, prompts(tok), params, tok.eos_token_id, tok.pad_token_id)
    assert len(compiled) == 2


@pytest.mark.parametrize("engine", ["rlhfkit", "hf"])
def test_seeded_prompts_draw_the_same_responses_in_any_batch(tiny, engine):
    """`seeds`: a prompt's responses depend on the prompt and its seed only — drawn alone, with another prompt before
    it, or in the other order (the layout of a 1- or 2-process run), they are the same tokens and log-probs; the
    caller's random state is left as it was."""
    from rlhfkit.generation import prompt_seed

    model, tok = tiny
    params = GenerationConfig(max_new_tokens=10, num_samples=3, engine=engine)
    batch = prompts(tok)
    seeds = [prompt_seed(42, 3, ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.attention_mask)]
    torch.manual_seed(0)
    both = generate(model, batch, params, tok.eos_token_id, tok.pad_token_id, seeds)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.rand(1) == after  # the seeded draws consumed nothing of the caller's stream
    flipped = generate(model, PromptBatch(batch.input_ids.flip(0), batch.attention_mask.flip(0)), params,
                       tok.eos_token_id, tok.pad_token_id, seeds[::-1])
    second = batch.attention_mask[1].bool()
    unpadded = batch.input_ids[1][second].unsqueeze(0)
    alone = generate(model, PromptBatch(unpadded, torch.ones_like(unpadded)), params, tok.eos_token_id,
                     tok.pad_token_id, seeds[1:])
    assert torch.equal(both.group_ids, torch.tensor([0, 0, 0, 1, 1, 1]))
    width = lambda ro, rows: int(ro.response_mask[rows].sum(1).max())  # noqa: E731
    for mine, theirs, rows_theirs in ((slice(3, 6), flipped, slice(0, 3)), (slice(3, 6), alone, slice(0, 3)),
                                      (slice(0, 3), flipped, slice(3, 6))):
        w = width(both, mine)
        assert w == width(theirs, rows_theirs)
        assert torch.equal(both.response_ids[mine, :w], theirs.response_ids[rows_theirs, :w])
        torch.testing.assert_close(both.sampler_logprobs[mine, :w], theirs.sampler_logprobs[rows_theirs, :w])
    # Different seeds draw different responses (the seed is used, not ignored).
    other = generate(model, batch, params, tok.eos_token_id, tok.pad_token_id, [s + 1 for s in seeds])
    assert not torch.equal(other.response_ids, both.response_ids)


def test_prompt_seed_is_a_function_of_seed_step_and_tokens():
    from rlhfkit.generation import prompt_seed

    ids = torch.tensor([5, 6, 7])
    assert prompt_seed(42, 3, ids) == prompt_seed(42, 3, ids.clone())
    assert len({prompt_seed(42, 3, ids), prompt_seed(43, 3, ids), prompt_seed(42, 4, ids),
                prompt_seed(42, 3, torch.tensor([5, 6, 8]))}) == 4
    assert 0 <= prompt_seed(42, 3, ids) < 2**63


@pytest.mark.parametrize("seeded_prompts", [False, True])
def test_generate_builds_no_autograd_graph(tiny, seeded_prompts):
    """Sampling runs without gradients even when called with them enabled on a trainable model: no graph through the
    decode loop's forwards (memory and time), none on the recorded log-probs."""
    model, tok = tiny
    assert any(p.requires_grad for p in model.parameters())
    batch = prompts(tok)
    seeds = [1, 2] if seeded_prompts else None
    with torch.enable_grad():
        ro = generate(model, batch, GenerationConfig(max_new_tokens=6, num_samples=2), tok.eos_token_id,
                      tok.pad_token_id, seeds)
    assert not ro.sampler_logprobs.requires_grad and ro.sampler_logprobs.grad_fn is None
