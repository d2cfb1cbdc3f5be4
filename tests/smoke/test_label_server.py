"""rlhfkit label as another site sees it: real HTTP requests to a running `rlhfkit label` (a subprocess, as a person
starts it) with a foreign Host (DNS rebinding), cross-site writes (what an HTML form or a no-cors fetch sends),
a foreign Origin, oversized bodies (declared and chunked), and per-person links. Each refusal is checked to change
nothing in the database and to carry none of the items' text."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from rlhfkit.cli import main
from rlhfkit.label.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = 64 * 1024  # the body cap the server promises (docs/human-feedback.md)
TEXTS = ("secret prompt", "left answer", "right answer")  # none may reach a refused request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rlhfkit label --candidates` in a subprocess; `lines` is what it printed."""

    def __init__(self, tmp_path, *extra: str):
        cands = tmp_path / "candidates.jsonl"
        cands.write_text("".join(json.dumps({"prompt": f"{TEXTS[0]} {i}", "responses": [f"{TEXTS[1]} {i}", f"{TEXTS[2]} {i}"]})
                                 + "\n" for i in range(4)))
        self.db, self.port, self.lines = str(tmp_path / "label.db"), _free_port(), []
        self.argv = [sys.executable, "-m", "rlhfkit.cli", "label", "--db", self.db, "--candidates", str(cands),
                     "--port", str(self.port), *extra]
        self.proc = None

    def start(self) -> "Server":
        self.lines = []
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, "".join(self.lines)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                time.sleep(0.2)  # the banner is printed before the server listens; let the reader thread catch up
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the label server did not start in 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def request(self, method: str, path: str, body=None, headers=None, host: str | None = None):
        """One request over a fresh connection; `host` replaces the Host header (default: 127.0.0.1:PORT)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers={"Host": f"127.0.0.1:{self.port}" if host is None else host, **(headers or {})},
                         encode_chunked=body is not None and not isinstance(body, (bytes, str)))
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def raw(self, data: bytes, wait: float = 5.0) -> bytes:
        """`data` as it is, on a socket; the answer that came back within `wait` seconds (b'' when none did)."""
        answer = b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=wait) as s:
            s.sendall(data)
            try:
                while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
            except TimeoutError:
                pass
        return answer

    def judgements(self) -> list[tuple]:
        return [(j.item, j.annotator, j.choice) for j in Store(self.db).judgements()]


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path, "--allow-host", "labels.example").start()
    yield s
    s.stop()


JSON = {"Content-Type": "application/json"}


def _json(status_body):
    return json.loads(status_body[1])


def _no_text(body: bytes) -> bool:
    return not any(t.encode() in body for t in TEXTS)


def test_a_foreign_host_gets_403_and_no_data(server):
    p = server.port
    for host in ("evil.example", f"evil.example:{p}", f"127.0.0.1:{p + 1}", f"localhost.evil.example:{p}",
                 f"labels.example:{p + 1}", "", f"0.0.0.0:{p}"):
        for path in ("/", "/static/label.js", "/api/progress", "/api/item?annotator=ann"):
            status, body = server.request("GET", path, host=host)
            assert status == 403, (host, path, status)
            assert _no_text(body) and b"rlhfkit label</title>" not in body and b"use strict" not in body, (host, path)
    status, body = server.request("POST", "/api/undo", json.dumps({"annotator": "ann"}), JSON, host=f"evil.example:{p}")
    assert status == 403 and _no_text(body)
    assert b"not a name this server answers to" in body and b"--allow-host" in body
    # HTTP/1.0 lets a client leave the Host out: refused too.
    assert server.raw(b"GET /api/item?annotator=ann HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 403")
    # Its own names, with its port, and what --allow-host added (with the port or without, as behind a proxy).
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"LOCALHOST:{p}", f"[::1]:{p}", "labels.example", f"labels.example:{p}"):
        status, body = server.request("GET", "/api/item?annotator=ann", host=host)
        assert status == 200 and TEXTS[0].encode() in body, (host, status, body)
    printed = "".join(server.lines)
    assert f"answers to Host localhost:{p}, 127.0.0.1:{p}, [::1]:{p}, labels.example, labels.example:{p}" in printed
    assert server.judgements() == []


def _first_judgement(server) -> dict:
    item = _json(server.request("GET", "/api/item?annotator=ann"))
    good = {"annotator": "ann", "item": item["item"], "token": item["token"], "choice": "a"}
    origin = {"Origin": f"http://127.0.0.1:{server.port}", "Sec-Fetch-Site": "same-origin"}  # what the page sends
    status, body = server.request("POST", "/api/judge", json.dumps(good), {**JSON, **origin})
    assert status == 200, body
    assert server.judgements() == [(0, "ann", "first")]
    return json.loads(body)["next"]


def test_cross_site_writes_are_refused_and_change_nothing(server):
    p = server.port
    nxt = _first_judgement(server)
    undo = json.dumps({"annotator": "ann"})
    judge = json.dumps({"annotator": "ann", "item": nxt["item"], "token": nxt["token"], "choice": "b"})
    refusals = [
        # An HTML form or a no-cors fetch from another site: text/plain, with that site's Origin.
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403),
        ({"Content-Type": "text/plain", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, 403),
        ({"Content-Type": "text/plain"}, 415),  # no Origin at all: the type alone is refused
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({}, 415),
        # A JSON write from another site's page (a preflight it never passed, or a browser that skipped it).
        ({**JSON, "Origin": "http://evil.example"}, 403),
        ({**JSON, "Origin": f"http://evil.example:{p}"}, 403),
        ({**JSON, "Origin": f"http://127.0.0.1:{p + 1}"}, 403),  # another program on this machine
        ({**JSON, "Origin": "null"}, 403),  # a sandboxed frame, a file:// page
        ({**JSON, "Sec-Fetch-Site": "cross-site"}, 403),
        ({**JSON, "Sec-Fetch-Site": "same-site"}, 403),  # another port of localhost is the same site, not us
    ]
    for headers, status in refusals:
        for path, body in (("/api/undo", undo), ("/api/judge", judge)):
            got, text = server.request("POST", path, body, headers)
            assert got == status, (path, headers, got, text)
            assert _no_text(text) and server.judgements() == [(0, "ann", "first")], (path, headers)
    # Reading the items from another site's page is refused too (a no-cors GET hands out an item).
    status, text = server.request("GET", "/api/item?annotator=ann", headers={"Sec-Fetch-Site": "cross-site"})
    assert status == 403 and _no_text(text)
    # A person who follows a link to the page from elsewhere still gets it.
    assert server.request("GET", "/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == 200
    # The page's own requests (same origin, JSON; a charset parameter is fine), and a script on this machine without
    # Origin, go through.
    own = {"Content-Type": "application/json; charset=utf-8", "Origin": f"http://localhost:{p}", "Sec-Fetch-Site": "same-origin"}
    status, text = server.request("POST", "/api/undo", undo, own, host=f"localhost:{p}")
    assert status == 200 and json.loads(text)["next"]["item"] == 0 and server.judgements() == []
    again = json.loads(text)["next"]
    status, _ = server.request("POST", "/api/judge", json.dumps({"annotator": "ann", "item": 0, "token": again["token"],
                                                                 "choice": "tie"}), JSON)
    assert status == 200 and server.judgements() == [(0, "ann", "tie")]


def _post_head(port: int, length: str, extra: str = "") -> bytes:
    return (f"POST /api/judge HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def _padded(size: int) -> bytes:
    """A judge request of exactly `size` bytes (an unknown item: a 404 when it is read)."""
    head = b'{"annotator": "ann", "item": 99, "token": "t", "choice": "a", "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_bodies_are_capped_before_they_are_read(server):
    p = server.port
    # A declared 10 MB body: refused on its Content-Length, after 100 bytes sent (a server that waited for the rest
    # would answer nothing within the 5 seconds).
    started = time.time()
    answer = server.raw(_post_head(p, str(10 * 1024 * 1024)) + b"{" * 100)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.time() - started < 5 and b"64 KB" in answer
    # At the cap it is read (an unknown item: 404); one byte over, refused.
    assert len(_padded(CAP)) == CAP
    assert server.request("POST", "/api/judge", _padded(CAP), JSON)[0] == 404
    assert server.request("POST", "/api/judge", _padded(CAP + 1), JSON)[0] == 413
    # Chunked, with no Content-Length: counted as it streams in.
    pieces = _padded(CAP + 1)
    assert server.request("POST", "/api/judge", iter([pieces[:40000], pieces[40000:]]), JSON)[0] == 413
    pieces = _padded(CAP)
    assert server.request("POST", "/api/judge", iter([pieces[:40000], pieces[40000:]]), JSON)[0] == 404
    # A chunked body that never ends is refused once it passes the cap, without waiting for the end.
    chunk = b"8000\r\n" + b"x" * 0x8000 + b"\r\n"
    answer = server.raw(_post_head(p, "0")[: -len(b"Content-Length: 0\r\n\r\n")] + b"Transfer-Encoding: chunked\r\n\r\n"
                        + chunk * 3)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert server.judgements() == []


def _links(lines: list[str]) -> dict[str, str]:
    """The per-person links the server printed: {name: token}."""
    out = {}
    for line in lines:
        name, _, url = line.strip().partition(": http://")
        if "?token=" in url and name in ("alice", "bob"):
            out[name] = url.split("?token=")[1].split("&")[0]
    return out


def test_per_person_links_judge_and_undo_only_as_themself(tmp_path):
    srv = Server(tmp_path, "--annotators", "alice,bob").start()
    try:
        tokens = _links(srv.lines)
        assert set(tokens) == {"alice", "bob"} and tokens["alice"] != tokens["bob"], srv.lines
        a, b = ({"X-Label-Token": tokens[n]} for n in ("alice", "bob"))
        assert srv.request("GET", "/api/item?annotator=alice")[0] == 401  # the loopback needs a link now
        assert _json(srv.request("GET", "/api/me", headers=a)) == {"annotator": "alice"}
        assert srv.request("GET", f"/?token={tokens['bob']}")[0] == 200
        for who, h in (("alice", a), ("bob", b)):
            item = _json(srv.request("GET", f"/api/item?annotator={who}", headers=h))
            status, _ = srv.request("POST", "/api/judge", json.dumps({"annotator": who, "item": item["item"],
                                                                       "token": item["token"], "choice": "a"}), {**JSON, **h})
            assert status == 200
        before = srv.judgements()
        assert [j[:2] for j in before] == [(0, "alice"), (2, "bob")]  # item 1 is alice's next, open
        # Bob's link cannot act as alice: not read her item, not undo her judgement.
        assert srv.request("GET", "/api/item?annotator=alice", headers=b)[0] == 403
        status, text = srv.request("POST", "/api/undo", json.dumps({"annotator": "alice"}), {**JSON, **b})
        assert status == 403 and b"bob" in text and srv.judgements() == before
        # Bob's undo takes back bob's judgement only.
        status, text = srv.request("POST", "/api/undo", json.dumps({"annotator": "bob"}), {**JSON, **b})
        assert status == 200 and json.loads(text)["next"]["item"] == 2
        assert srv.judgements() == before[:1]
        # A restart prints the same links: each person's address keeps working.
        srv.stop()
        srv.start()
        assert _links(srv.lines) == tokens
        assert _json(srv.request("GET", "/api/me", headers=a)) == {"annotator": "alice"}
    finally:
        srv.stop()
    # Without --annotators, one person on the loopback needs no link, and /api/me names nobody.
    (tmp_path / "solo").mkdir()
    solo = Server(tmp_path / "solo").start()
    try:
        assert _json(solo.request("GET", "/api/me")) == {"annotator": None}
    finally:
        solo.stop()


def test_bad_sharing_flags_are_one_line_and_exit_2(tmp_path, capsys):
    cands = tmp_path / "c.jsonl"
    cands.write_text(json.dumps({"prompt": "p", "responses": ["a", "b"]}) + "\n")
    base = ["label", "--db", str(tmp_path / "l.db"), "--candidates", str(cands), "--port", "0"]
    for extra, message in [
        (["--annotators", "alice,alice"], "--annotators: 'alice' is named twice"),
        (["--annotators", "alice,"], "--annotators: expected names of 1-64 letters"),
        (["--annotators", "al/ice"], "--annotators: expected names of 1-64 letters"),
        (["--annotators", "alice", "--token", "t" * 20], "--token does not apply with --annotators"),
        (["--allow-host", "http://labels.example/"], "--allow-host 'http://labels.example/': expected a host name"),
        (["--allow-host", "labels.example:port"], "--allow-host 'labels.example:port': expected a host name"),
    ]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("rlhfkit: error:") and message in err, (extra, err)
