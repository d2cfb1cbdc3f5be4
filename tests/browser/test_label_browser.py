"""rlhfkit label in a real browser: headless Chromium (Debian's chromium and chromium-driver) drives the page by
keyboard, the server is killed with SIGKILL and restarted, the page resumes at the next item, and the export trains
a reward model with `rlhfkit rm`. Saves the page's screenshot to docs/images/label.png."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from rlhfkit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run installs them)")

SCRIPT = "<script>document.title = 'pwned'</script><b>bold?</b>"
TOOL_TURNS = [
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "{\"sky\": \"sunny\", \"celsius\": 21}"},
    {"role": "assistant", "content": "It is sunny in Paris, 21 °C."},
]
LAMPS = [{"prompt": f"Review the lamp Saloto {i}.", "models": ["ppo", "sft"],
          "responses": [f"A great, bright lamp ({i}).", f"A dull, awful lamp ({i})."]} for i in range(4)]
CANDIDATES = [
    {"prompt": "Review the film Kalo.", "responses": [SCRIPT, "A wonderful, moving film."], "models": ["ppo", "sft"]},
    LAMPS[0],
    # Judged a tie below, so the export (which trains the tiny reward model) holds text pairs only.
    {"prompt": [{"role": "system", "content": "You can call get_weather."}, {"role": "user", "content": "Weather in Paris?"}],
     "responses": [TOOL_TURNS, [{"role": "assistant", "content": "I cannot know the weather."}]], "models": ["ppo", "sft"]},
    *LAMPS[1:],
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rlhfkit label` in a subprocess, as a person runs it."""

    def __init__(self, argv: list[str], port: int):
        self.argv, self.port, self.proc = argv, port, None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli", "label", *self.argv, "--port", str(self.port)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/progress", timeout=1)
                return
            except urllib.error.HTTPError:  # up, and asking for a link's token (--annotators)
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the label server did not start in 60 s")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,720", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def server(tmp_path):
    cands = tmp_path / "candidates.jsonl"
    cands.write_text("".join(json.dumps(c) + "\n" for c in CANDIDATES))
    db = str(tmp_path / "label.db")
    s = Server(["--db", db, "--candidates", str(cands)], _free_port())
    s.start()
    yield s, db
    if s.proc.poll() is None:
        s.proc.terminate()
        s.proc.wait(10)


def _item(driver) -> str | None:
    return driver.find_element("id", "work").get_attribute("data-item")


def _press(driver, key: str, expect_item: str | None = None) -> None:
    """A key on the page; with `expect_item`, wait until that item is on screen (the server answered)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element("tag name", "body").send_keys(key)
    if expect_item is not None:
        WebDriverWait(driver, 10).until(lambda d: _item(d) == expect_item and not d.find_element("id", "work").get_attribute("hidden"))


def _open(driver, port: int, annotator: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"http://127.0.0.1:{port}/?annotator={annotator}")
    WebDriverWait(driver, 10).until(lambda d: _item(d) is not None and d.find_element("id", "progress").text)


def test_label_by_keyboard_kill9_resume_export_and_train(browser, server, tmp_path):
    srv, db = server
    _open(browser, srv.port, "alice")
    assert _item(browser) == "0"
    _press(browser, "1", "1")  # A better
    _press(browser, "h")  # flag A harmful, then B better
    _press(browser, "2", "2")
    _press(browser, "u", "1")  # undo: item 1 again, the flag cleared
    assert "harmful" not in browser.find_element("id", "side-a").get_attribute("class")
    _press(browser, "j")
    _press(browser, "2", "2")
    os.makedirs(os.path.join(ROOT, "docs", "images"), exist_ok=True)  # the screenshot docs/human-feedback.md shows
    browser.save_screenshot(os.path.join(ROOT, "docs", "images", "label.png"))
    _press(browser, "3", "3")  # tie: the tool conversation
    assert browser.find_element("id", "progress").text == "done 3 / 6"
    # SIGKILL, restart, reload: the three acknowledged judgements are there and the page resumes at item 3.
    srv.kill9()
    srv.start()
    _open(browser, srv.port, "alice")
    assert _item(browser) == "3" and browser.find_element("id", "progress").text == "done 3 / 6"
    assert browser.find_element("id", "who").text == "alice: 3 judged"
    _press(browser, "1", "4")
    _press(browser, "4", "5")  # both bad
    _press(browser, "2")
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 10).until(lambda d: d.find_element("id", "finished").is_displayed())
    assert browser.find_element("id", "progress").text == "done 6 / 6"
    # Export while the server runs; ties and "both bad" stay out: items 0, 1, 3, 5.
    out = str(tmp_path / "prefs.jsonl")
    flags = str(tmp_path / "flags.jsonl")
    assert main(["label", "--db", db, "--export", out, "--export-flags", flags]) == 0
    rows = [json.loads(line) for line in open(out)]
    assert sorted(r["item"] for r in rows) == [0, 1, 3, 5] and {r["annotator"] for r in rows} == {"alice"}
    seen = [json.loads(line) for line in open(flags)]  # every response seen on a judged item, flagged or not
    assert len(seen) == 12
    (flag,) = [row for row in seen if row["harmful"]]
    assert flag["prompt"] == CANDIDATES[1]["prompt"] and flag["annotator"] == "alice"
    run = str(tmp_path / "rm")
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"data.train={out}", f"data.eval={out}", "max_steps=2",
                 "optim.per_device_batch_size=2", "logging.logging_steps=1", "logging.eval_steps=2", f"output_dir={run}"]) == 0
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2] and any("eval/accuracy" in m for m in metrics)


def test_markup_in_a_response_is_shown_as_text(browser, server):
    srv, _ = server
    _open(browser, srv.port, "bob")
    assert _item(browser) == "0"
    sides = browser.find_element("id", "left").text + browser.find_element("id", "right").text
    assert SCRIPT in sides  # the tags themselves are on screen
    assert browser.find_elements("css selector", "#left b, #right b, #left script, #right script") == []
    assert browser.title == "rlhfkit label"  # the script never ran
    _press(browser, "1", "1")
    _press(browser, "1", "2")  # the tool conversation renders each turn, the call and the tool's result readably
    text = browser.find_element("id", "side-a").text + browser.find_element("id", "side-b").text
    assert "get_weather({\"city\":\"Paris\"})" in text and "TOOL · GET_WEATHER" in text and "It is sunny in Paris" in text


def test_per_person_links_act_as_their_person(browser, tmp_path):
    """`--annotators alice,bob`: each printed link opens the page as its person (no name asked), in one browser."""
    from selenium.webdriver.support.ui import WebDriverWait

    from rlhfkit.label.store import Store

    cands = tmp_path / "candidates.jsonl"
    cands.write_text("".join(json.dumps(c) + "\n" for c in LAMPS))
    db = str(tmp_path / "people.db")
    srv = Server(["--db", db, "--candidates", str(cands), "--annotators", "alice,bob"], _free_port())
    srv.start()
    try:
        links: dict[str, str] = {}
        while len(links) < 2:  # printed before the server listened
            name, _, url = srv.proc.stdout.readline().strip().partition(": ")
            if url.startswith("http://"):
                links[name] = url
        for who, first, nxt in (("alice", "0", "1"), ("bob", "2", "3")):  # alice holds item 1 open when bob comes
            browser.get(links[who])
            WebDriverWait(browser, 10).until(lambda d, first=first: _item(d) == first and d.find_element("id", "who").text)
            assert browser.find_element("id", "who").text == f"{who}: 0 judged"
            assert not browser.find_element("id", "signin").is_displayed()
            _press(browser, "1", nxt)
        assert [(j.item, j.annotator) for j in Store(db).judgements()] == [(0, "alice"), (2, "bob")]
        browser.get(f"http://127.0.0.1:{srv.port}/")  # no link, but the cookie of the last one opened: bob
        WebDriverWait(browser, 10).until(lambda d: d.find_element("id", "who").text == "bob: 1 judged")
    finally:
        srv.proc.terminate()
        srv.proc.wait(10)
