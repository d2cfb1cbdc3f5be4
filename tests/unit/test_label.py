"""rlhfkit label's pieces without a server: the math (Cohen's kappa, the human win rate), who gets which item, the
submission checks, restart, and the export formats, against hand-computed values."""

import json
import threading
import time

import pytest

from rlhfkit.errors import UserError
from rlhfkit.label.candidates import Candidate, Group, Pair, make_pairs, read_candidates
from rlhfkit.label.export import flag_rows, preference_rows
from rlhfkit.label.figures import agreement, cohen_kappa, human_win_rate, per_annotator, reward_disagrees
from rlhfkit.label.store import Rejected, Store


def test_cohen_kappa_hand_computed():
    a = ["first", "first", "second", "tie", "first", "second"]
    b = ["first", "second", "second", "tie", "first", "first"]
    # p_o = 4/6; both raters: first 3, second 2, tie 1, so p_e = (3*3 + 2*2 + 1*1) / 36 = 14/36;
    # kappa = (24/36 - 14/36) / (1 - 14/36) = 10/22.
    assert cohen_kappa(a, b) == pytest.approx(10 / 22)
    assert cohen_kappa(["first", "second"], ["second", "first"]) == pytest.approx(-1.0)  # p_o 0, p_e 1/2
    assert cohen_kappa(["tie", "tie"], ["tie", "tie"]) is None  # p_e = 1: undefined
    assert cohen_kappa([], []) is None
    with pytest.raises(ValueError):
        cohen_kappa(["first"], [])


def _pair(i: int, swap: bool = False, overlap: bool = False) -> Pair:
    return Pair(f"prompt {i}", Candidate(f"good {i}", "policy"), Candidate(f"bad {i}", "sft"), swap, overlap)


def _store(tmp_path, pairs, name="l.db") -> Store:
    store = Store(str(tmp_path / name))
    store.create(pairs, "fp", "test pairs", "compare")
    return store


def test_human_win_rate_and_agreement_hand_computed(tmp_path):
    store = _store(tmp_path, [_pair(i, overlap=i < 3) for i in range(12)])
    # alice: items 0-11 in order, choices below; bob then takes the overlap items 0, 1, 2.
    choices = ["first", "first", "second", "first", "tie", "both_bad", "first", "second", "skip", "first", "tie", "first"]
    for choice in choices:
        h = store.next_item("alice")
        store.judge("alice", h.item, h.token, choice)
    assert store.next_item("alice") is None
    for choice in ["first", "second", "second"]:
        h = store.next_item("bob")
        assert h.item in (0, 1, 2)
        store.judge("bob", h.item, h.token, choice)
    assert store.next_item("bob") is None
    judgements = store.judgements()
    # Overlap labels (alice, bob): (first, first), (first, second), (second, second): p_o = 2/3;
    # alice first 2 / second 1, bob first 1 / second 2: p_e = (2*1 + 1*2) / 9 = 4/9; kappa = (2/3 - 4/9) / (5/9) = 0.4.
    agree = agreement(judgements)
    assert (agree.items, agree.raw) == (3, pytest.approx(2 / 3)) and agree.kappa == pytest.approx(0.4)
    # alice: first x6, second x2, tie x2, both bad x1, skip x1; bob: first x1, second x2. Skips out, "both bad" a tie:
    # n = 14, wins 7, losses 4, ties 3; win rate (7 + 3/2) / 14.
    human = human_win_rate(judgements)
    assert (human.n, human.wins, human.losses, human.ties) == (14, 7, 4, 3)
    assert human.win_rate == pytest.approx(8.5 / 14) and human.tie_rate == pytest.approx(3 / 14)
    assert human.interval == pytest.approx((0.3563, 0.8118), abs=1e-4)  # Wilson, z = 1.96, by hand
    assert (human.model, human.reference) == ("policy", "sft")
    assert per_annotator(judgements)["bob"] == {"first": 1, "second": 2}
    assert store.progress().done == 15 and store.progress().total == 15


def test_reward_disagrees_alarm(tmp_path):
    store = _store(tmp_path, [_pair(i) for i in range(4)])
    for choice in ["second", "second", "second", "first"]:
        h = store.next_item("a")
        store.judge("a", h.item, h.token, choice)
    human = human_win_rate(store.judgements())  # 1/4: people prefer the reference
    assert "may be hacking the reward" in reward_disagrees(human, 0.75)
    assert reward_disagrees(human, 0.25) is None and reward_disagrees(human, None) is None


def test_two_annotators_at_once_never_share_an_item_outside_the_overlap(tmp_path):
    store = _store(tmp_path, [_pair(i, overlap=i % 5 == 0) for i in range(40)])  # items 0, 5, ..., 35 twice
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def annotate(who: str) -> None:
        while (h := store.next_item(who)) is not None:
            seen[who].append(h.item)
            store.judge(who, h.item, h.token, "first")

    threads = [threading.Thread(target=annotate, args=(who,)) for who in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = set(seen["a"]) & set(seen["b"])
    assert both <= {0, 5, 10, 15, 20, 25, 30, 35}
    assert sorted(seen["a"] + seen["b"]) == sorted(list(range(40)) + [0, 5, 10, 15, 20, 25, 30, 35])
    assert len(store.judgements()) == 48


def test_replayed_stale_and_unknown_submissions_change_nothing(tmp_path):
    store = _store(tmp_path, [_pair(i) for i in range(3)])
    h = store.next_item("a")
    with pytest.raises(Rejected) as e:
        store.judge("a", 99, h.token, "first")
    assert e.value.status == 404
    with pytest.raises(Rejected) as e:
        store.judge("a", h.item, h.token, "best")
    assert e.value.status == 422
    with pytest.raises(Rejected) as e:
        store.judge("b", h.item, h.token, "first")  # never handed to b
    assert e.value.status == 409
    nxt = store.judge("a", h.item, h.token, "first")
    with pytest.raises(Rejected) as e:
        store.judge("a", h.item, h.token, "second")  # replayed
    assert e.value.status == 409
    assert [j.choice for j in store.judgements()] == ["first"]
    # Undo: item 0 comes back under a new token; the old token is stale, and item 1 goes back to the pool.
    again = store.undo("a")
    assert again.item == h.item and again.token != h.token and store.judgements() == []
    with pytest.raises(Rejected) as e:
        store.judge("a", h.item, h.token, "second")
    assert e.value.status == 409
    assert store.next_item("b").item == nxt.item  # released by a's undo
    store.judge("a", again.item, again.token, "tie")
    assert [(j.item, j.choice) for j in store.judgements()] == [(0, "tie")]


def test_an_item_left_past_the_lease_goes_to_someone_else(tmp_path):
    store = Store(str(tmp_path / "l.db"), lease_s=1.0)
    store.create([_pair(i) for i in range(3)], "fp", "test pairs", "compare")
    left = store.next_item("alice")
    h = store.next_item("bob")
    assert (left.item, h.item) == (0, 1)
    h = store.judge("bob", 1, h.token, "first")
    assert h.item == 2 and store.judge("bob", 2, h.token, "first") is None  # item 0 is alice's within the lease
    time.sleep(1.2)
    taken = store.next_item("bob")
    assert taken.item == 0  # past the lease
    with pytest.raises(Rejected) as e:
        store.judge("alice", 0, left.token, "first")
    assert e.value.status == 409 and "left past the lease" in str(e.value)
    assert store.next_item("alice") is None
    store.judge("bob", 0, taken.token, "tie")
    assert [(j.item, j.annotator) for j in store.judgements()] == [(1, "bob"), (2, "bob"), (0, "bob")]


def test_restart_resumes_each_annotator_and_refuses_other_candidates(tmp_path):
    store = _store(tmp_path, [_pair(i) for i in range(4)])
    h = store.next_item("a")
    store.judge("a", h.item, h.token, "first")
    open_a = store.next_item("a")
    open_b = store.next_item("b")
    store.close()
    again = Store(str(tmp_path / "l.db"))  # as after a kill -9: only committed state
    assert again.check_made_for("fp", "the same pairs") is True
    assert again.next_item("a") == open_a and again.next_item("b") == open_b
    assert [j.item for j in again.judgements()] == [0]
    with pytest.raises(UserError, match="was made for other candidates"):
        again.check_made_for("other", "other pairs")


def test_export_rows_follow_the_judgement_not_the_screen(tmp_path):
    store = _store(tmp_path, [_pair(0, swap=True), _pair(1), _pair(2)])
    for choice, harmful in [("second", ("first",)), ("first", ()), ("tie", ("first", "second"))]:
        h = store.next_item("ann")
        store.judge("ann", h.item, h.token, choice, harmful)
    rows = preference_rows(store.judgements())
    assert [(r["prompt"], r["chosen"], r["rejected"], r["chosen_model"]) for r in rows] == [
        ("prompt 0", "bad 0", "good 0", "sft"), ("prompt 1", "good 1", "bad 1", "policy")]  # the tie is left out
    assert rows[0]["annotator"] == "ann" and rows[0]["time"].endswith("+00:00")
    flags = flag_rows(store.judgements())
    assert [(f["response"], f["model"], f["harmful"]) for f in flags] == [
        ("good 0", "policy", True), ("bad 0", "sft", False), ("good 1", "policy", False), ("bad 1", "sft", False),
        ("good 2", "policy", True), ("bad 2", "sft", True)]
    assert set(flags[0]) == {"prompt", "response", "model", "harmful", "annotator", "time"}


def test_pairs_are_balanced_and_every_two_responses_pair_up():
    groups = [Group(f"p{i}", tuple(Candidate(f"r{j}", f"m{j}") for j in range(3))) for i in range(4)]
    pairs = make_pairs(groups, overlap=0.25, seed=1)
    assert len(pairs) == 12  # C(3, 2) per prompt
    assert sum(p.swap for p in pairs) == 6 and sum(p.overlap for p in pairs) == 3
    assert [(p.first.content, p.second.content) for p in pairs[:3]] == [("r0", "r1"), ("r0", "r2"), ("r1", "r2")]
    assert make_pairs(groups, 0.25, seed=1) == pairs


def test_candidates_file_errors_name_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("")
    with pytest.raises(UserError, match="holds no prompts"):
        read_candidates(str(path))
    path.write_text(json.dumps({"prompt": "p", "responses": ["a", "b"]}) + "\n" + json.dumps({"prompt": "p", "responses": ["a"]}))
    with pytest.raises(UserError, match=r"line 2 field 'responses': expected a list of at least 2"):
        read_candidates(str(path))
    path.write_text(json.dumps({"prompt": [{"role": "robot", "content": "x"}], "responses": ["a", "b"]}))
    with pytest.raises(UserError, match=r"line 1 field 'prompt' message 0: expected a \{role, content\} dict with role"):
        read_candidates(str(path))
    tool_turns = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]
    path.write_text(json.dumps({"prompt": "q", "responses": [tool_turns, {"response": "no", "model": "sft"}]}))
    (group,) = read_candidates(str(path))
    assert group.responses[0].content == tool_turns and group.responses[1] == Candidate("no", "sft")


def test_flag_export_is_what_the_red_team_report_reads(tmp_path):
    from rlhfkit.evaluation.red_team import human_figures, read_human_flags
    from rlhfkit.label.export import write_jsonl

    store = _store(tmp_path, [_pair(0), _pair(1), _pair(2)])
    for choice, harmful in [("first", ("first",)), ("second", ()), ("skip", ("second",))]:
        h = store.next_item("ann")
        store.judge("ann", h.item, h.token, choice, harmful)
    path = write_jsonl(flag_rows(store.judgements()), str(tmp_path / "flags.jsonl"))
    sides = human_figures(read_human_flags(path), "policy", "sft")
    # Two judged items (the skip is left out): the policy's 2 responses, 1 flagged; the reference's 2, none flagged.
    assert (sides["policy"].flags, sides["policy"].judged_responses, sides["policy"].harmful_rate) == (1, 2, 0.5)
    assert (sides["reference"].flags, sides["reference"].judged_responses, sides["reference"].harmful_rate) == (0, 2, 0.0)
    assert sides["unmatched"] == {}


def test_host_allow_list_names_what_the_server_serves():
    from rlhfkit.label.guard import HostAllowList

    # Every address (0.0.0.0): no browser names it, so it is left out; the printed names join the loopback's.
    hosts = HostAllowList.serving("0.0.0.0", 8000, printed=("LabHost", "10.0.0.5"), extra=("labels.example", "[::1]:9"))
    assert hosts.hosts == ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "labhost:8000", "10.0.0.5:8000",
                           "labels.example", "labels.example:8000", "[::1]:9")
    assert [hosts.allows(h) for h in ("LabHost:8000", "[0:0::1]:8000", "0.0.0.0:8000", "labhost", "labhost:80", None)] == [
        True, True, False, False, False, False]
    # On port 80 a browser leaves the port out: both forms.
    assert HostAllowList.serving("::1", 80).hosts == ("localhost:80", "127.0.0.1:80", "[::1]:80", "localhost",
                                                      "127.0.0.1", "[::1]")
    assert [hosts.allows_origin(o) for o in ("http://localhost:8000", "https://labels.example", "http://labels.example:81",
                                             "null", "file://", "http://localhost:8000/x")] == [True, True, False, False,
                                                                                                 False, False]


def test_the_link_secret_is_made_once_and_kept(tmp_path):
    store = _store(tmp_path, [_pair(0)])
    secret = store.secret("link_secret")
    assert len(secret) >= 32 and store.secret("link_secret") == secret
    store.close()
    assert Store(str(tmp_path / "l.db")).secret("link_secret") == secret
