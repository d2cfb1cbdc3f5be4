"""rlhfkit label through its HTTP routes and its command line: every bad request is a 4xx that changes nothing, the
access token is checked on every request, bad configuration is one line and exit 2, and candidates sampled from tiny
models (collect and compare mode) are stored once."""

import json
import logging
import os
import socket

import pytest
from starlette.testclient import TestClient

from rlhfkit.cli import main
from rlhfkit.label.app import make_app
from rlhfkit.label.candidates import Candidate, Pair
from rlhfkit.label.command import LabelOptions, access_token, prepare
from rlhfkit.label.store import Store

PROMPTS = "data/tiny/prompts_eval.jsonl"
LOCAL = "http://127.0.0.1:8000"  # the address the app serves by default (a foreign Host is refused)
JSON = {"Content-Type": "application/json"}  # writes are taken only as JSON


@pytest.fixture
def store(tmp_path):
    store = Store(str(tmp_path / "l.db"))
    pairs = [Pair(f"p{i}", Candidate(f"x{i}", "m1"), Candidate(f"y{i}", "m2"), swap=i == 0) for i in range(3)]
    store.create(pairs, "fp", "test", "collect")
    return store


def _state(store: Store):
    return [(j.item, j.annotator, j.choice, j.harmful) for j in store.judgements()], store.progress()


def test_bad_requests_get_a_4xx_and_change_nothing(store):
    client = TestClient(make_app(store), base_url=LOCAL)
    item = client.get("/api/item", params={"annotator": "ann"}).json()
    assert (item["item"], item["a"], item["b"]) == (0, "y0", "x0")  # item 0 is swapped: the second response on the left
    before = _state(store)
    good = {"annotator": "ann", "item": 0, "token": item["token"], "choice": "a", "harmful": ["b"]}
    bad = [
        (b"{not json", 400, "malformed body"), (b"[1, 2]", 400, "malformed body"),
        ({**good, "item": "0"}, 400, "'item' must be an integer"), ({**good, "annotator": ""}, 400, "annotator"),
        ({**good, "item": 42}, 404, "unknown item 42"), ({**good, "choice": "c"}, 422, "unknown choice 'c'"),
        ({**good, "harmful": ["left"]}, 422, "harmful"), ({**good, "token": "forged"}, 409, "stale submission"),
    ]
    for body, status, message in bad:
        r = client.post("/api/judge", content=body if isinstance(body, bytes) else json.dumps(body), headers=JSON)
        assert r.status_code == status and message in r.json()["error"], (body, r.status_code, r.text)
        assert _state(store) == before
    r = client.post("/api/judge", json=good)
    assert r.status_code == 200 and r.json()["saved"] is True and r.json()["next"]["item"] == 1
    # The left response ("a") of swapped item 0 is the pair's second: chosen; "b" (the first) was flagged harmful.
    assert _state(store)[0] == [(0, "ann", "second", ("first",))]
    after = _state(store)
    r = client.post("/api/judge", json=good)  # replayed
    assert r.status_code == 409 and "already judged" in r.json()["error"] and _state(store) == after
    assert client.get("/api/item", params={"annotator": "<script>"}).status_code == 400
    # The page may run only its own script, whatever a response holds.
    assert client.get("/").headers["content-security-policy"].startswith("default-src 'self'; script-src 'self'")
    assert client.post("/api/undo", content=b"nope", headers=JSON).status_code == 400 and _state(store) == after
    r = client.post("/api/undo", json={"annotator": "ann"})
    assert r.json()["next"]["item"] == 0 and store.judgements() == []
    assert client.get("/api/progress").json() == {"done": 0, "total": 3, "annotators": {}}


def test_two_annotators_at_once_through_the_routes(tmp_path):
    import threading

    store = Store(str(tmp_path / "two.db"))
    store.create([Pair(f"p{i}", Candidate("x", "m1"), Candidate("y", "m2"), overlap=i < 4) for i in range(20)], "fp", "t", "collect")
    client = TestClient(make_app(store), base_url=LOCAL)
    judged: dict[str, list[int]] = {"ann": [], "bob": []}

    def annotate(who: str) -> None:
        item = client.get("/api/item", params={"annotator": who}).json()
        while not item.get("done"):
            judged[who].append(item["item"])
            r = client.post("/api/judge", json={"annotator": who, "item": item["item"], "token": item["token"], "choice": "b"})
            item = r.json()["next"]

    threads = [threading.Thread(target=annotate, args=(who,)) for who in judged]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(judged["ann"]) & set(judged["bob"]) == {0, 1, 2, 3}  # the overlap, and nothing else, twice
    assert sorted(judged["ann"] + judged["bob"]) == sorted(list(range(20)) + [0, 1, 2, 3])
    assert client.get("/api/progress").json()["done"] == 24


def test_every_request_needs_the_token(store):
    token = "t" * 24
    client = TestClient(make_app(store, token), base_url=LOCAL)
    for path in ("/", "/static/label.js", "/api/progress", "/api/item?annotator=a"):
        r = client.get(path)
        assert r.status_code == 401 and "access token" in r.json()["error"], path
        assert client.get(path, headers={"X-Label-Token": "t" * 23 + "u"}).status_code == 401
    r = client.post("/api/judge", json={"annotator": "a", "item": 0, "token": "x", "choice": "a"})
    assert r.status_code == 401 and store.judgements() == []
    assert client.get("/api/progress", headers={"X-Label-Token": token}).status_code == 200
    page = client.get(f"/?token={token}")  # the printed address: sets the cookie the page's requests then carry
    assert page.status_code == 200 and "rlhfkit label" in page.text
    assert client.get("/static/label.js").status_code == 200 and client.get("/api/progress").status_code == 200
    assert access_token("127.0.0.1", None) is None and len(access_token("0.0.0.0", None)) >= 16
    assert access_token("192.168.1.5", token) == token


def _one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlhfkit: error:"), err
    return err


def test_bad_configuration_is_one_line_and_exit_2(tmp_path, capsys):
    cands = tmp_path / "c.jsonl"
    cands.write_text(json.dumps({"prompt": "p", "responses": ["a", "b"]}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    db = str(tmp_path / "l.db")
    assert "holds no prompts" in _one_error_line(capsys, ["label", "--db", db, "--candidates", str(empty), "--port", "0"])
    assert "no records" in _one_error_line(capsys, ["label", "--db", db, "--model", "tiny", "--prompts", str(empty), "--port", "0"])
    (tmp_path / "a_file").write_text("")
    err = _one_error_line(capsys, ["label", "--db", str(tmp_path / "a_file" / "l.db"), "--candidates", str(cands), "--port", "0"])
    assert "cannot be opened for writing" in err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _one_error_line(capsys, ["label", "--db", db, "--candidates", str(cands), "--port", str(port)])
        assert f"cannot listen on 127.0.0.1:{port}" in err
    prepare(Store(db), LabelOptions(db=db, candidates=str(cands)))
    cands.write_text(json.dumps({"prompt": "q", "responses": ["c", "d"]}) + "\n")  # other candidates, same --db
    assert "was made for other candidates" in _one_error_line(capsys, ["label", "--db", db, "--candidates", str(cands), "--port", "0"])
    assert "does not exist" in _one_error_line(capsys, ["label", "--db", str(tmp_path / "no.db"), "--export", "x.jsonl"])
    assert "--lease must be" in _one_error_line(capsys, ["label", "--db", db, "--candidates", str(cands), "--lease", "0"])
    assert "--candidates does not apply" in _one_error_line(capsys, ["label", "--db", db, "--export", "x.jsonl",
                                                                      "--candidates", str(cands)])
    assert "--reward-model is read by" in _one_error_line(capsys, ["label", "--db", db, "--export", "x.jsonl",
                                                                   "--reward-model", "rm"])
    assert "--overlap must be" in _one_error_line(capsys, ["label", "--db", db, "--candidates", str(cands), "--overlap", "2"])
    assert "only generation.* overrides" in _one_error_line(capsys, ["label", "--db", db, "--model", "tiny", "--prompts",
                                                                     PROMPTS, "optim.lr=1", "--port", "0"])
    assert "compare-mode database" in _one_error_line(capsys, ["label", "--db", db, "--result", str(tmp_path)])


GEN = ("generation.max_new_tokens=6",)


@pytest.fixture(scope="module")
def compare_db(tmp_path_factory):
    """Compare mode, tiny against tiny on 4 prompts: the settings `eval_dir` evaluates with."""
    opts = LabelOptions(db=str(tmp_path_factory.mktemp("compare") / "v.db"), model="tiny", compare="tiny",
                        prompts=PROMPTS, overrides=GEN, max_prompts=4)
    prepare(Store(opts.db), opts)
    return opts


def test_collect_and_compare_sample_once(tmp_path, caplog, compare_db):
    collect = LabelOptions(db=str(tmp_path / "c.db"), model="tiny", prompts=PROMPTS, overrides=GEN, num_samples=3,
                           max_prompts=2, overlap=0.5)
    prepare(Store(collect.db), collect)
    pairs = Store(collect.db).pairs()
    assert len(pairs) == 6 and sum(p.overlap for p in pairs) == 3 and sum(p.swap for p in pairs) == 3  # C(3, 2) x 2
    assert pairs[0].prompt == "Review the lamp Saloto." and {p.first.model for p in pairs} == {"tiny"}
    pairs = Store(compare_db.db).pairs()
    assert len(pairs) == 4 and sum(p.swap for p in pairs) == 2
    # The same model under the same seed per batch: both sides drew the same response (rlhfkit eval's pairing).
    assert all(p.first.content == p.second.content for p in pairs)
    with caplog.at_level(logging.INFO, logger="rlhfkit"):
        prepare(Store(compare_db.db), compare_db)  # a restart: nothing sampled again
    assert "4 items already stored; resuming" in caplog.text and Store(compare_db.db).pairs() == pairs


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A reward model directory: the tiny model with a random score head (saved as `rlhfkit rm` saves)."""
    import torch

    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_reward_model, load_tokenizer, save_model

    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path="tiny")
    out = str(tmp_path_factory.mktemp("rm") / "rm")
    save_model(load_reward_model(cfg, trainable=False, allow_new_head=True), load_tokenizer(cfg), out)
    return out


def test_compare_result_beside_eval_json_and_figures(tmp_path, compare_db, rm_dir, capsys):
    from rlhfkit.evaluation.report import write_report

    eval_dir = str(tmp_path / "eval")
    assert main(["eval", "--config", "configs/eval_tiny.yaml", f"data.eval={PROMPTS}", "max_prompts=4", "batch_size=8",
                 "generation.max_new_tokens=6", f"output_dir={eval_dir}"]) == 0
    with open(os.path.join(eval_dir, "eval.json")) as f:
        report = json.load(f)
    store = Store(compare_db.db)
    # Compare mode's pairs are the samples rlhfkit eval scored (same prompts, settings, seed and batch size).
    assert [p.first.content for p in store.pairs()] == [s["policy"]["response"] for s in report["samples"]]
    for choice in ("second", "second", "first", "second"):  # people prefer the reference 3 times out of 4
        h = store.next_item("ann")
        store.judge("ann", h.item, h.token, choice)
    assert main(["label", "--db", compare_db.db, "--result", eval_dir, "--reward-model", rm_dir]) == 0
    assert "human win rate 0.250 (95% CI 0.046-0.699), tie rate 0.000, n=4" in capsys.readouterr().out
    with open(os.path.join(eval_dir, "human_eval.json")) as f:
        human = json.load(f)
    assert (human["n"], human["wins"], human["losses"], human["win_rate"]) == (4, 1, 3, 0.25)
    assert human["interval"] == pytest.approx([0.0456, 0.6994], abs=1e-4)  # Wilson, 1 of 4, by hand
    assert human["judge_win_rate"] == report["win_rate"]
    # The two sides' responses are identical: the reward model scores them alike (win rate exactly 1/2, no alarm).
    rm = human["reward_model"]
    assert rm["win_rate"] == 0.5 and rm["mean_score"]["model"] == pytest.approx(rm["mean_score"]["reference"], abs=1e-5) and human["alarms"] == []
    assert "Blind human evaluation (human_eval.json)" in open(write_report(eval_dir)).read()
    figures = str(tmp_path / "figures")
    assert main(["label", "--db", compare_db.db, "--figures", figures, "--reward-model", rm_dir]) == 0
    with open(os.path.join(figures, "label_figures.json")) as f:
        fig = json.load(f)
    assert fig["per_annotator"] == {"ann": {"second": 3, "first": 1}} and fig["pairs"] == 4
    assert fig["reward_model_accuracy"] == 0.0  # identical responses: no pair ordered (a tie counts as wrong)
    assert os.path.getsize(os.path.join(figures, "label_figures.png")) > 1000
