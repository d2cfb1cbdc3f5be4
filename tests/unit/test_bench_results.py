"""Measured figures are data: each docs/results/<name>.md is its .json rendered, with its provenance; the benchmarks
write that format through bench/results.py."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import results  # noqa: E402  (bench/results.py: bench/ is not a package)
import demo_results  # noqa: E402

PROVENANCE = ("name", "title", "date", "machine", "commit", "command", "columns", "rows", "notes")


def committed_results() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json")))


@pytest.mark.parametrize("path", committed_results(), ids=os.path.basename)
def test_each_table_is_its_data_rendered_with_provenance(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert all(data.get(k) not in (None, "") for k in PROVENANCE[:6]), f"{path}: needs {', '.join(PROVENANCE[:6])}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]) and re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", data["commit"])
    assert all(len(row) == len(data["columns"]) for row in data["rows"])
    with open(path[: -len(".json")] + ".md", encoding="utf-8") as f:
        assert f.read() == results.render(data), f"{path}: the .md is stale: run `python bench/results.py`"


def test_every_included_table_exists():
    pages = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    included = {m for p in pages for m in re.findall(r'--8<-- "docs/results/(\w+)\.md"', open(p, encoding="utf-8").read())}
    assert included and included <= {os.path.basename(p)[:-5] for p in committed_results()}


def test_record_stamps_date_machine_and_commit(tmp_path):
    path = results.record("example", "An example", ["stage", "s/step"], [["sft", "0.056"], ["dpo", "0.155"]],
                          command="python bench/example.py", notes=["A note."], directory=str(tmp_path))
    data = json.loads((tmp_path / "example.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert data["commit"].split("+")[0] == head and f"{os.cpu_count()} CPU cores (load average " in data["machine"]
    assert open(path, encoding="utf-8").read().splitlines()[2:6] == [
        "| stage | s/step |", "|---|---|", "| sft | 0.056 |", "| dpo | 0.155 |"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        results.record("bad", "Bad", ["a", "b"], [["only one"]], command="x", directory=str(tmp_path))


def test_the_demo_table_reads_eval_json():
    figures = {"gold_reward": 0.5141, "kl_to_sft": 3.071, "win_rate_gold": 0.7708, "win_rate_rm": 0.6458,
               "distinct_2": 0.9262, "eos_rate": 0.5833, "mean_words": 18.31, "alignment_tax_nats": 0.0341}
    rows = demo_results.rows({"sft": {**figures, "kl_to_sft": 0.0}, "ppo": figures, "best_of_4": figures})
    assert rows[1] == ["PPO", "0.514", "3.07", "77.1%", "64.6%", "0.926", "58.3%", "18.3", "+0.034"]
    assert rows[0][2] == "0" and rows[0][-1] == "0" and rows[2][2] == "≤ 3.07"


def test_every_benchmark_writes_its_table():
    scripts = [p for p in glob.glob(os.path.join(ROOT, "bench", "*.py")) if os.path.basename(p) != "results.py"]
    silent = [os.path.basename(p) for p in scripts if "record(" not in open(p, encoding="utf-8").read()]
    assert not silent, f"these benchmarks write no table through bench/results.py's record(): {silent}"


def test_the_readme_states_only_measured_figures():
    """The front page's headline figures are copies: each must be in a table of docs/results/ (rerun, then copy)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    data = "".join(open(p, encoding="utf-8").read() for p in committed_results())
    figures = re.findall(r"\d+\.\d+|\d+(?=\s?(?:%|×| s\b| MB))", section)
    assert len(figures) >= 10
    missing = [x for x in figures if x not in data]
    assert not missing, f"README.md's Measured section states figures no docs/results/ table holds: {missing}"
