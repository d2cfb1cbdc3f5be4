"""Red-teaming through `rlhfkit eval` on tiny models: a policy made worse on purpose (fine-tuned to emit a marker the
synthetic judge calls harmful) raises the alarm against its reference, the other way round it does not; the
classifier judge; human flags; bad input as one line and exit 2. No harmful text anywhere: the "harm" is "##"."""

import json

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.evaluation.judges import verdicts
from rlhfkit.evaluation.red_team import ClassifierJudge
from rlhfkit.evaluation.report import write_report
from rlhfkit.reward_functions import RewardInputs

MARKER = "##"
PROMPTS = "data/tiny/red_team.jsonl"


def marker_judge(completions):
    """The synthetic safety judge (`test_red_team_cli:marker_judge`): a response is harmful when it holds the marker."""
    return [MARKER in c for c in completions]


def marker_refusal(completions):
    """A scripted refusal detector: the marker responses count as refusals (so refusals = harmful, checkably)."""
    return [MARKER in c for c in completions]


def returns_two(completions):
    return [2.0] * len(completions)


BASE = ["eval", "--config", "configs/eval_tiny.yaml", "max_prompts=4", f"red_team.prompts={PROMPTS}",
        "red_team.judge=test_red_team_cli:marker_judge"]


@pytest.fixture(scope="module")
def worse_policy(tmp_path_factory):
    """The tiny model fine-tuned for 12 SFT steps to answer every red-team prompt with the marker."""
    root = tmp_path_factory.mktemp("worse")
    with open(PROMPTS, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    data = root / "marker.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": "## ## ## ##"}) + "\n" for p in prompts * 2))
    out = root / "sft"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", f"data.train={data}", "data.eval=null",
                 "max_steps=12", "optim.lr=1e-2", "optim.warmup_steps=0", "logging.progress_bar=false"]) == 0
    return str(out)


def red_team(out) -> dict:
    return json.loads((out / "eval.json").read_text())


def test_policy_made_worse_raises_the_alarm(worse_policy, tmp_path, capsys):
    flags = tmp_path / "flags.jsonl"
    flags.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "p1", "response": "## ##", "model": worse_policy, "harmful": True, "annotator": "a", "time": "t"},
        {"prompt": "p2", "response": "####", "model": worse_policy + "/", "harmful": True, "annotator": "b"},
        {"prompt": "p1", "response": "x#", "model": "tiny", "harmful": True, "annotator": "a"},
        {"prompt": "p2", "response": "ok", "model": "tiny", "harmful": False, "annotator": "a"},
        {"prompt": "p3", "response": "?", "model": "someone-else", "harmful": True, "annotator": "a"},
    ]))
    out = tmp_path / "eval"
    assert main(BASE + [f"output_dir={out}", f"model.name_or_path={worse_policy}", f"red_team.human_flags={flags}"]) == 0
    report = red_team(out)
    section = report["red_team"]
    pol, ref = section["policy"], section["reference"]
    assert section["num_prompts"] == 16 and pol["responses"] == ref["responses"] == pol["judged"] == 16
    assert pol["harmful"] >= 8 and ref["harmful"] == 0  # 12 steps of SFT; a random model never writes "##" here
    assert pol["harmful_rate"] == pol["harmful"] / 16 and ref["harmful_interval"][0] == 0.0
    assert pol["harmful_interval"][0] > ref["harmful_interval"][1]  # the intervals separate
    assert pol["refusal_rate"] == ref["refusal_rate"] == 0.0  # neither model writes a refusal phrase
    # Every response of the policy that the judge calls harmful got worse, since the reference has none.
    worse = section["worse"]
    assert worse["count"] == pol["harmful"] and worse["better_count"] == 0
    assert all(MARKER in w["policy"] and MARKER not in w["reference"] for w in worse["prompts"])
    assert section["alarm"] == {"fired": True, "rule": section["alarm"]["rule"], "intervals_overlap": False}
    [alarm] = [a for a in report["alarms"] if a["source"] == "red_team"]
    assert alarm["name"] == "red_team_harmful_rate" and f"{pol['harmful']}/16" in alarm["message"]
    # Human flags: two rows for the policy (its path spelt two ways), one of two judged responses of the reference.
    human = section["human"]
    assert (human["policy"]["flags"], human["policy"]["annotators"], human["policy"]["harmful_rate"]) == (2, 2, None)
    assert human["reference"]["harmful_rate"] == 0.5 and human["unmatched"] == {"someone-else": 1}
    printed = capsys.readouterr().out
    assert f"red team, policy   : harmful {pol['harmful']}/16" in printed and "alarm red_team_harmful_rate" in printed
    assert "human flags, policy   : 2 response(s) flagged harmful by 2 annotator(s)" in printed
    page = open(write_report(str(out)), encoding="utf-8").read()
    assert f"Red-team responses that got worse ({worse['count']}; 0 got better)" in page


def test_safer_policy_or_the_same_policy_raises_none(worse_policy, tmp_path):
    # The other way round: the policy is the random model, its reference the one that writes the marker.
    out = tmp_path / "safer"
    assert main(BASE + [f"output_dir={out}", f"reference={worse_policy}",
                        "red_team.refusal_function=test_red_team_cli:marker_refusal"]) == 0
    report = red_team(out)
    section = report["red_team"]
    assert section["policy"]["harmful"] == 0 and section["reference"]["harmful"] >= 8
    assert section["worse"]["count"] == 0 and section["worse"]["better_count"] == section["reference"]["harmful"]
    assert section["alarm"]["fired"] is False and not [a for a in report["alarms"] if a["source"] == "red_team"]
    assert section["reference"]["refusals"] == section["reference"]["harmful"]  # the scripted detector was used
    assert section["refusal_detector"] == "test_red_team_cli:marker_refusal"
    # The same model on both sides: the same samples, equal rates, nothing got worse.
    out = tmp_path / "same"
    assert main(BASE + [f"output_dir={out}", f"model.name_or_path={worse_policy}", f"reference={worse_policy}",
                        "red_team.max_prompts=8"]) == 0
    section = red_team(out)["red_team"]
    assert section["policy"] == section["reference"] and section["policy"]["harmful"] > 0
    assert section["worse"]["count"] == section["worse"]["better_count"] == 0 and not section["alarm"]["fired"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A tiny random Llama sequence classifier with labels safe / harmful and the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhfkit.model_sources import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=24,
                         pad_token_id=tokenizer.pad_token_id, num_labels=2,
                         id2label={0: "safe", 1: "harmful"}, label2id={"safe": 0, "harmful": 1})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(config)
    path = str(tmp_path_factory.mktemp("classifier"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("pair", [False, True])
def test_classifier_judge_is_the_models_own_probability(classifier_dir, pair):
    """Batched and padded, the judge gives each text the softmax share of "harmful" the model gives it alone, cut at
    the model's 24 positions (the tiny tokenizer records no limit)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["short", "a much longer response of many characters", "mid length"]
    prompts = ["p one", "p two is longer", "p3"]
    judge = ClassifierJudge(classifier_dir, "harmful", pair, "cpu", batch_size=2)
    got = verdicts(judge, None, RewardInputs(prompts=prompts, completions=texts, completion_ids=[[0]] * 3))
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    with torch.no_grad():
        alone = [torch.softmax(model(**tokenizer(*([p] if pair else []), t, truncation=True, max_length=24,
                                                 return_tensors="pt")).logits, -1)[0, 1].item()
                 for p, t in zip(prompts, texts)]
    assert got == pytest.approx(alone, abs=1e-5)
    assert len({round(x, 6) for x in got}) == 3  # a random head: three different texts, three scores
    if not pair:  # the 41-character response is read as its first 24 characters
        cut = RewardInputs(prompts=["p"], completions=[texts[1][:24]], completion_ids=[[0]])
        assert verdicts(judge, None, cut)[0] == pytest.approx(got[1])


def test_classifier_judge_refuses_bad_models(classifier_dir, tmp_path):
    with pytest.raises(UserError, match=r"red_team.harmful_label 'toxic' is not a label .*\(its labels: harmful, safe\)"):
        ClassifierJudge(classifier_dir, "toxic", False, "cpu", 2)
    with pytest.raises(UserError, match="red_team.classifier '.*missing': cannot load"):
        ClassifierJudge(str(tmp_path / "missing"), "harmful", False, "cpu", 2)
    from rlhfkit.model_sources import build_tiny_model

    build_tiny_model(str(tmp_path / "lm"))
    with pytest.raises(UserError, match="is a LlamaForCausalLM, not a text-classification model"):
        ClassifierJudge(str(tmp_path / "lm"), "harmful", False, "cpu", 2)


def test_classifier_through_the_cli(classifier_dir, tmp_path):
    """The classifier's harmfulness reaches the figures: every softmax share is above a threshold of 1e-6, so every
    response is harmful; the policy against itself gives equal figures on both sides and no alarm."""
    out = tmp_path / "eval"
    assert main(["eval", "--config", "configs/eval_tiny.yaml", "max_prompts=4", f"output_dir={out}",
                 f"red_team.prompts={PROMPTS}", "red_team.max_prompts=4", f"red_team.classifier={classifier_dir}",
                 "red_team.harmful_label=harmful", "red_team.threshold=1e-6"]) == 0
    section = red_team(out)["red_team"]
    assert section["judge"] == f"classifier {classifier_dir} (label 'harmful', input response)"
    assert section["policy"] == section["reference"] and section["policy"]["judged"] == 4
    assert section["policy"]["harmful"] == 4 and section["alarm"]["fired"] is False


@pytest.fixture
def empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize("overrides, expected", [
    (["red_team.prompts=missing.jsonl"], "red_team.prompts: data file 'missing.jsonl' not found"),
    (["red_team.prompts={empty}"], "red_team.prompts: {empty}: no records"),
    (["red_team.judge=no_such_module:judge"], "red_team.judge 'no_such_module:judge': cannot import module"),
    (["red_team.judge=test_red_team_cli:no_such_judge"], "module 'test_red_team_cli' has no function 'no_such_judge'"),
    (["red_team.judge=null", "red_team.classifier={classifier}", "red_team.harmful_label=toxic"],
     "red_team.harmful_label 'toxic' is not a label of classifier"),
    (["red_team.human_flags={empty}/nothing.jsonl"], "red_team.human_flags: file"),
    (["red_team.judge=test_red_team_cli:returns_two", "red_team.max_prompts=1"], "returned 2.0 at row 0"),
])
def test_bad_input_is_one_line(overrides, expected, empty_file, classifier_dir, tmp_path, capsys):
    fill = {"empty": empty_file, "classifier": classifier_dir}
    overrides = [o.format(**fill) for o in overrides]
    assert main(BASE + [f"output_dir={tmp_path / 'e'}"] + overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert expected.format(**fill) in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "e" / "eval.json").exists()


def test_red_teaming_alone_needs_no_held_out_prompts(tmp_path, capsys):
    """`rlhfkit eval` with red_team.prompts and no data.eval red-teams alone: the same red_team section as with
    data.eval (the red-team prompts are drawn with the same seed either way), no helpfulness figures. Settings that
    only judge data.eval's samples are refused without it, in one line."""
    alone, both = tmp_path / "alone", tmp_path / "both"
    assert main(BASE + [f"output_dir={both}", "red_team.max_prompts=4"]) == 0
    assert main(BASE + [f"output_dir={alone}", "red_team.max_prompts=4", "data.eval=null", "reward.function=null",
                        "max_prompts=null"]) == 0
    with_eval, without = red_team(both), red_team(alone)
    assert without["red_team"] == with_eval["red_team"] and without["red_team"]["num_prompts"] == 4
    assert without["num_prompts"] == 0 and without["policy"] is None and without["samples"] == []
    printed = capsys.readouterr().out
    assert "red team, policy   : harmful" in printed
    for extra, expected in ((["data.eval=null", "red_team.prompts=null", "red_team.judge=null"],
                             "config key 'data.eval' is required (held-out prompts: a local file or a hub dataset "
                             "name), unless eval only red-teams (red_team.prompts or red_team.human_flags)"),
                            (["data.eval=null"], "config key 'reward.function' judges data.eval's samples: give data.eval"),
                            (["data.eval=null", "reward.function=null"],
                             "config key 'max_prompts' limits data.eval's prompts: give data.eval")):
        assert main(BASE + [f"output_dir={tmp_path / 'bad'}", *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"rlhfkit: error: {expected}"
