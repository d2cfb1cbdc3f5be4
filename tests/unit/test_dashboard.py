"""Dashboard, frontier plot and HTML report on run directories built by hand (no model, no training)."""

import json
import re
from pathlib import Path
from html.parser import HTMLParser

import pytest
from PIL import Image

from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.evaluation.dashboard import frontier_figure, run_title, write_dashboard, write_frontier_plot
from rlhfkit.evaluation.report import write_report, write_run_artifacts

CONFIG = "output_dir: {out}\nlogging:\n  run_name: null\nalgo:\n  algorithm: ppo\n  lam: 0.95\n  clip_eps: 0.2\n"
PROMPTS = ["Review the lamp.", "Review the <b>film</b>."]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def online_run(tmp_path):
    run = tmp_path / "ppo_run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG.format(out=run))
    _write_jsonl(run / "metrics.jsonl", [
        {"step": s, "objective/scores": 0.1 * s, "objective/kl": 0.05 * s, "objective/kl_coef": 0.05,
         "policy/clipfrac_avg": 0.1, "loss/policy_avg": -0.01, "loss/value_avg": 1.0 / s, "lr": 1e-3}
        for s in range(1, 11)])
    _write_jsonl(run / "samples.jsonl", [
        {"step": 1, "prompt": PROMPTS[0], "response": "meh lamp", "score": 0.25, "kl": 0.0},
        {"step": 1, "prompt": PROMPTS[1], "response": "<script>alert(1)</script>", "score": -0.5, "kl": 0.0},
        # the last step sampled the same prompts, in the other order: pairs follow the prompts, not the lines
        {"step": 10, "prompt": PROMPTS[1], "response": "a wonderful film", "score": 0.875, "kl": 0.5},
        {"step": 10, "prompt": PROMPTS[0], "response": "a great lamp", "score": 0.75, "kl": 0.4},
    ])
    return run


@pytest.fixture
def offline_run(tmp_path):
    run = tmp_path / "rm_run"
    run.mkdir()
    (run / "config.yaml").write_text(f"output_dir: {run}\nalgo:\n  margin_scale: 1.0\n  center_coef: 0.0\n")
    _write_jsonl(run / "metrics.jsonl", [
        {"step": 5, "loss": 0.69, "accuracy": 0.5, "margin": 0.0, "lr": 1e-3},
        {"step": 10, "loss": 0.5, "accuracy": 0.75, "margin": 0.5, "lr": 1e-3},
        {"step": 10, "eval/loss": 0.4, "eval/accuracy": 0.8125},
    ])
    (run / "eval.json").write_text(json.dumps({"gold_reward": 0.3125, "kl": 1.5}))
    return run


class _Collect(HTMLParser):
    """Parses the page (an error would raise) and keeps the text and the <img> sources."""

    def __init__(self):
        super().__init__()
        self.text, self.images = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def _parse(path):
    page = path.read_text()
    parser = _Collect()
    parser.feed(page)
    parser.close()
    return page, "".join(parser.text), parser.images


def _is_png(path):
    assert path.stat().st_size > 0
    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG"


def test_dashboard_online_and_offline(online_run, offline_run):
    for run in (online_run, offline_run):
        path = write_dashboard(str(run))
        assert path == str(run / "dashboard.png")
        _is_png(run / "dashboard.png")
        assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]  # the temp file was renamed away
    assert run_title(str(online_run), {"algo": {"algorithm": "ppo", "lam": 0.95}}) == "ppo_run · ppo"
    assert run_title(str(offline_run), {"algo": {"margin_scale": 1.0}}) == "rm_run · rm"


def test_frontier_plot_one_entry_per_method(tmp_path):
    points = {"DPO": [(2.0, 0.6), (0.5, 0.4), (8.0, 0.7)], "PPO": [(1.0, 0.5), (4.0, 0.55)], "SFT": [(0.0, 0.2)]}
    legend = frontier_figure(points).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["DPO", "PPO", "SFT"]
    line = frontier_figure(points).axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [0.5, 2.0, 8.0]  # a curve runs in order of KL
    out = tmp_path / "figs" / "frontier.png"
    assert write_frontier_plot(points, str(out)) == str(out)
    _is_png(out)
    with pytest.raises(ValueError):
        write_frontier_plot({"DPO": []}, str(out))


def test_report_online(online_run, tmp_path):
    extra_fig = tmp_path / "frontier.png"
    write_frontier_plot({"PPO": [(0.5, 0.75)]}, str(extra_fig))
    table = [{"method": "PPO", "gold": 0.75, "kl": 0.5}, {"method": "DPO <beta>", "gold": 0.625, "kl": 1.25}]
    path = write_report(str(online_run), {"tables": {"Method comparison": table}, "figures": [str(extra_fig)]})
    page, text, images = _parse(online_run / "report.html")
    assert path == str(online_run / "report.html")
    assert len(images) == 1 and all(re.fullmatch(r"data:image/png;base64,[A-Za-z0-9+/=]+", src) for src in images)
    assert CONFIG.format(out=online_run) in text  # the config, verbatim, in its <pre>
    assert "objective/scores" in text and ">1</td>" in page and ">0.1</td>" in page  # final values: step 10
    assert "Method comparison" in text and "DPO <beta>" in text and "0.625" in text
    # before/after side by side, paired by prompt: one row per prompt
    rows = re.findall(r"<tr>(.*?)</tr>", page, re.S)
    lamp = next(r for r in rows if "Review the lamp." in r)
    assert "meh lamp" in lamp and "0.25" in lamp and "a great lamp" in lamp and "0.75" in lamp
    film = next(r for r in rows if "Review the &lt;b&gt;film" in r)
    assert "-0.5" in film and "a wonderful film" in film and "0.875" in film
    # untrusted text is escaped: the page has no live <script> or <b>, the reader sees the text
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert(1)</script>" in text


def test_report_unmatched_prompts_and_explicit_samples(online_run):
    _write_jsonl(online_run / "samples.jsonl", [
        {"step": 1, "prompt": "p1", "response": "r1", "score": 0.0, "kl": 0.0},
        {"step": 7, "prompt": "p9", "response": "r9", "score": 1.0, "kl": 0.1},
    ])
    page, text, _ = _parse(Path(write_report(str(online_run))))
    assert "step 1 (before) vs step 7 (after)" in text
    assert "p1" in text and "p9" in text and "r1" in text and "r9" in text
    samples = [{"prompt": "q", "before": "old", "before_score": 0.125, "after": "new", "after_score": 0.5}]
    page, text, _ = _parse(Path(write_report(str(online_run), {"samples": samples})))
    assert "old" in text and "new" in text and "0.125" in text and "r9" not in text


def test_report_pairs_training_samples_not_eval_samples(online_run):
    """Eval samples (`"split": "eval"`) logged at the last step stay out of the training's before/after pairs."""
    with open(online_run / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "prompt": "held out", "response": "eval answer", "score": 0.5, "kl": 0.1,
                            "split": "eval"}) + "\n")
    page, text, _ = _parse(Path(write_report(str(online_run))))
    assert "step 1 (before) vs step 10 (after)" in text and "a great lamp" in text
    assert "held out" not in text and "eval answer" not in text


def test_report_offline_with_eval_json(offline_run):
    _, text, images = _parse(Path(write_report(str(offline_run))))
    assert images == []  # no dashboard.png beside the report, no extra figures
    assert "eval/accuracy" in text and "0.8125" in text  # eval rows count among the final metrics
    assert "eval.json" in text and "gold_reward" in text and "0.3125" in text
    assert "margin_scale: 1.0" in text
    assert "Samples" not in text


def test_run_artifacts_never_raise(online_run, tmp_path):
    assert write_run_artifacts(str(online_run)) == [str(online_run / "dashboard.png"), str(online_run / "report.html")]
    empty = tmp_path / "crashed"
    empty.mkdir()
    (empty / "config.yaml").write_text("algo:\n  completion_only: true\n")
    assert write_run_artifacts(str(empty)) == [str(empty / "report.html")]  # no metrics: no dashboard, still a report
    assert write_run_artifacts(str(tmp_path / "missing")) == []
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_dashboard(str(empty))


def test_cli(online_run, tmp_path, capsys):
    out = tmp_path / "elsewhere"
    assert main(["dashboard", str(online_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "dashboard.png"), str(out / "report.html")]
    _is_png(out / "dashboard.png")
    assert len(_parse(out / "report.html")[2]) == 1  # the report embeds the dashboard lying beside it
    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhfkit: error: ") and "does not exist" in err[0]
    (tmp_path / "bare").mkdir()
    assert main(["dashboard", str(tmp_path / "bare")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
