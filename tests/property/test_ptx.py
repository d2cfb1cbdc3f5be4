"""PPO-ptx (`algo.ptx_coef`, `data.ptx`): the update's gradient is the policy loss's plus ptx_coef × the gradient of
the ptx batch's token-mean NLL, whatever the micro-batching; ptx_coef=0 is the plain online step; bad ptx input is
one line, exit status 2.

The gradient is read through a public seam, the weights after one step: with Adam's eps and lr both 1e6 the first
AdamW step is -lr · g / (|g| + eps) ≈ -g, so the weight change *is* the gradient (to ~1e-6 relative).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import DataConfig, ModelConfig
from rlhfkit.data import build_datasets, collate_sft
from rlhfkit.models import load_causal_lm, load_tokenizer

# One GRPO step: 2 prompts × 4 samples = one minibatch of 8 rows, so the ptx batch holds 8 records: all of PTX_ROWS.
STEP = ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=1", "logging.progress_bar=false",
        "algo.rollout_batch_size=2", "generation.max_new_tokens=6", "optim.lr=1e6", "optim.adam_eps=1e6",
        "optim.max_grad_norm=null", "optim.weight_decay=0"]
PTX_ROWS = 8
COEF = 0.5


def ptx_file(tmp_path) -> str:
    with open("data/tiny/sft_train.jsonl") as f:
        lines = f.readlines()[:PTX_ROWS]
    path = tmp_path / "ptx.jsonl"
    path.write_text("".join(lines))
    return str(path)


def weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def hand_built_ptx_gradient(path: str) -> dict[str, torch.Tensor]:
    """∇ of COEF × the mean NLL of every labelled token of the ptx records under the initial tiny policy, written out
    with log_softmax and gather (not through losses.sft)."""
    cfg = ModelConfig(name_or_path="tiny")
    tok = load_tokenizer(cfg)
    model = load_causal_lm(cfg, tok)
    model.eval()  # dropout off, as the online loop's policy (algo.disable_dropout)
    examples, _ = build_datasets("sft", DataConfig(train=path, max_length=128, max_prompt_length=64), tok, 0)
    batch = collate_sft(examples, tok.pad_token_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    targets, logp = batch.labels[:, 1:], torch.log_softmax(logits[:, :-1], -1)
    scored = targets != -100
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[scored]
    (COEF * nll.mean()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_ptx_gradient_is_the_sum_of_both_losses_gradients_at_any_micro_batching(tmp_path):
    ptx = ptx_file(tmp_path)
    plain = str(tmp_path / "plain")
    assert main([*STEP, f"output_dir={plain}", "algo.ptx_coef=0", "optim.per_device_batch_size=8"]) == 0
    assert "loss/ptx_avg" not in rows(plain)[0]
    g_ptx = hand_built_ptx_gradient(ptx)
    w_plain = weights(plain)
    for micro in (8, 2):
        mixed = str(tmp_path / f"mixed{micro}")
        assert main([*STEP, f"output_dir={mixed}", f"data.ptx={ptx}", f"algo.ptx_coef={COEF}",
                     f"optim.per_device_batch_size={micro}"]) == 0
        w_mixed = weights(mixed)
        moved = 0
        for name, g in g_ptx.items():
            # w_mixed - w_plain = -(g_policy + COEF·g_ptx) + g_policy: the same rollout, so the same policy part.
            torch.testing.assert_close(w_mixed[name] - w_plain[name], -g, rtol=1e-3, atol=2e-5,
                                       msg=lambda m, n=name: f"micro={micro} {n}: {m}")
            moved += int(g.abs().max() > 1e-3)
        assert moved > 0  # the ptx gradient is not vanishing: the comparison has teeth
        # loss/ptx_avg is the token-mean NLL before the step: COEF·NLL = the hand-built loss / COEF · COEF.
        assert rows(mixed)[0]["loss/ptx_avg"] > 0
    assert rows(str(tmp_path / "mixed8"))[0]["loss/ptx_avg"] == pytest.approx(rows(str(tmp_path / "mixed2"))[0]["loss/ptx_avg"], rel=1e-5)


def test_ptx_coef_zero_is_the_plain_online_step(tmp_path):
    """An explicit ptx_coef=0 changes nothing: the same metrics (wall times aside) and bit-identical weights."""
    fast = ["max_steps=1", "logging.progress_bar=false", "algo.rollout_batch_size=2", "generation.max_new_tokens=6"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={a}", *fast]) == 0
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={b}", "algo.ptx_coef=0", *fast]) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(rows(a)) == strip(rows(b))
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def run_cli(capsys, args):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("rlhfkit: error:")], err


@pytest.mark.parametrize("text, expected", [
    ("", "data.ptx (SFT records: prompt/completion, messages or text): "),
    ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n', "data.ptx (SFT records: prompt/completion, messages or text): "),
], ids=["empty", "preference-records"])
def test_bad_ptx_set_is_one_line_exit_2(text, expected, tmp_path, capsys):
    path = tmp_path / "ptx.jsonl"
    path.write_text(text)
    code, errors, err = run_cli(capsys, ["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={tmp_path / 'run'}",
                                         "max_steps=1", f"data.ptx={path}", "algo.ptx_coef=0.5"])
    assert code == 2
    assert len(errors) == 1 and expected in errors[0] and str(path) in errors[0], err
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stage, overrides, message", [
    ("grpo", ["algo.ptx_coef=0.5"], "config key 'algo.ptx_coef' is 0.5 but data.ptx is not set"),
    ("grpo", ["data.ptx=data/tiny/sft_train.jsonl"], "config key 'data.ptx' is mixed in with weight algo.ptx_coef, which is 0"),
    ("dpo", ["data.ptx=data/tiny/sft_train.jsonl"], "config key 'data.ptx' is read by the online stages only"),
], ids=["coef-without-data", "data-without-coef", "offline-stage"])
def test_ptx_settings_come_together_or_are_refused(stage, overrides, message, tmp_path, capsys):
    code, errors, err = run_cli(capsys, [stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={tmp_path / 'run'}",
                                         *overrides])
    assert code == 2
    assert len(errors) == 1 and message in errors[0], err
