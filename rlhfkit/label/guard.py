"""What the labelling server refuses before any route runs: requests that another site's page could make.

A page the annotator visits elsewhere can reach a server on their own machine in two ways, and neither needs the
access token when there is none (the loopback, one person):

- **DNS rebinding.** The other site points its own name at 127.0.0.1; the browser then treats the labelling page as
  that site's, and its script reads every prompt and response. The request still names the other site in its
  `Host` header, so the server answers only the names it serves (`HostAllowList`): the address it listens on,
  `localhost`, `127.0.0.1` and `[::1]` with its port, the names it prints beyond the loopback, and `--allow-host`.
- **Cross-site writes.** An HTML form or a no-cors `fetch` may POST to any address without asking, with a
  `text/plain` or form body; it cannot read the answer, but the write happens. The API therefore takes only
  `application/json` bodies (a type another site's page can send only after a CORS preflight, which this server
  never grants), and refuses a request whose `Origin` is not one of its own names, or whose `Sec-Fetch-Site` says
  another site (`cross-site`, or `same-site`: another port of localhost is another program).

Bodies are capped (`MAX_BODY`) before they are read: a declared `Content-Length` over the cap is refused at once,
and a chunked body is counted as it arrives and refused when it passes the cap.

The same questions Jupyter's server answers (`allow_remote_access` / `local_hostnames`, its XSRF and Origin
checks, its body limits), written for this server's one store and four routes. Refusals are JSON
`{"error": message}` with a 4xx, and carry none of the items' text.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlsplit

COOKIE = "rlhfkit_label_token"
MAX_BODY = 64 * 1024  # bytes; a judgement is well under 1 KB
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_ANNOTATOR = re.compile(r"^[\w.@ -]{1,64}$")
_NAME = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)(:[0-9]{1,5})?$")
_SAFE_SITES = ("same-origin", "none")  # Sec-Fetch-Site: the page itself, or an address the person typed
_HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
            (b"x-content-type-options", b"nosniff")]


def valid_annotator(value) -> bool:
    """An annotator's name: 1-64 letters, digits, spaces or . _ @ -."""
    return isinstance(value, str) and bool(_ANNOTATOR.match(value))


def host_name(host: str) -> str:
    """A host as a `Host` header or a URL writes it: an IPv6 address in brackets, any address in its short form, a
    name lower-cased."""
    try:
        address = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return host.lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def split_host(host: str) -> tuple[str, str | None]:
    """'name:port', '[v6]:port' or a bare name -> (name, port or None)."""
    if host.startswith("["):
        name, _, rest = host.partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(host)
        return name + "]", rest[1:] if rest else None
    name, sep, port = host.rpartition(":")
    return (name, port) if sep else (host, None)


def normal_host(host: str) -> str:
    name, port = split_host(host)
    return host_name(name) + ("" if port is None else f":{port}")


def check_host_entry(entry: str) -> str:
    """An `--allow-host` value, NAME or NAME:PORT, normalised; ValueError for anything else (a URL, a path, a bad
    port)."""
    port = split_host(entry)[1] if _NAME.match(entry) else "0"
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"--allow-host '{entry}': expected a host name or address, optionally with :PORT (such as "
                         "labels.example or 10.0.0.5:8000), not a URL")
    return normal_host(entry)


@dataclass(frozen=True)
class HostAllowList:
    """The `Host` values (and `Origin` host parts) this server answers to, each exactly as a browser writes it."""

    hosts: tuple[str, ...]

    @classmethod
    def serving(cls, bound: str, port: int, printed: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> HostAllowList:
        """`bound` (unless it is every address, 0.0.0.0 or ::, which no browser names), the loopback names and the
        `printed` names, each with `port` (and bare on port 80, where browsers leave it out); an `extra` name with
        its port is taken as it is, one without as both bare (a proxy in front, on 80 or 443) and with `port`."""
        names = [*LOOPBACK_NAMES, *printed]
        if bound not in ("0.0.0.0", "::", ""):
            names.append(host_name(bound))
        hosts = [f"{host_name(n)}:{port}" for n in names] + [host_name(n) for n in names if port == 80]
        for entry in map(check_host_entry, extra):
            hosts += [entry] if split_host(entry)[1] is not None else [entry, f"{entry}:{port}"]
        return cls(tuple(dict.fromkeys(hosts)))

    def allows(self, host: str | None) -> bool:
        try:
            return bool(host) and normal_host(host) in self.hosts
        except ValueError:
            return False

    def allows_origin(self, origin: str) -> bool:
        """An `Origin` header: one of this server's own addresses (over http or, behind a proxy, https)."""
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and not parts.path.strip("/") and self.allows(parts.netloc)


@dataclass(frozen=True)
class Access:
    """Who may use the server: nobody needs a token (`tokens` empty), everyone shares one (mapped to None), or each
    person has their own (mapped to their name: they judge and undo only as themself)."""

    tokens: dict[str, str | None]

    @classmethod
    def single(cls, token: str | None) -> Access:
        return cls({} if token is None else {token: None})

    @classmethod
    def links(cls, people: dict[str, str]) -> Access:
        """Per-person links: {name: token}."""
        return cls({token: name for name, token in people.items()})

    @property
    def open(self) -> bool:
        return not self.tokens

    @property
    def personal(self) -> bool:
        return any(name is not None for name in self.tokens.values())

    def token_of(self, headers: dict[str, str], query: dict[str, str]) -> str | None:
        """The known token the request carries: from the address (?token=), the `X-Label-Token` header or the
        cookie, in that order; None when it carries none that is known."""
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except CookieError:
            pass
        given = [query.get("token"), headers.get("x-label-token"), cookie[COOKIE].value if COOKIE in cookie else None]
        for g in given:
            if g is not None:
                for known in self.tokens:
                    if hmac.compare_digest(g.encode(), known.encode()):
                        return known
        return None

    def person(self, token: str | None) -> str | None:
        return None if token is None else self.tokens.get(token)


def request_parts(scope) -> tuple[dict[str, str], dict[str, str]]:
    """A request's headers (lower-case names; a repeated header: its last value) and query parameters."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    return headers, dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [*_HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the module docstring's checks, then the access token, then the body, read up to the cap,
    handed on to the app. Refusals: 403 foreign Host or site, 415 a write that is not JSON, 401 no token, 413 a body
    over the cap (400 a Content-Length that is not a number)."""

    def __init__(self, app, hosts: HostAllowList, access: Access, max_body: int = MAX_BODY):
        self.app, self.hosts, self.access, self.max_body = app, hosts, access, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, query = request_parts(scope)
        refusal = self.refusal(scope, headers, query)
        if refusal is not None:
            return await _refuse(send, *refusal)
        body, over = await self.read_body(receive)
        if over:
            return await _refuse(send, 413, f"request body over {self.max_body // 1024} KB")
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def refusal(self, scope, headers: dict[str, str], query: dict[str, str]) -> tuple[int, str] | None:
        """(status, message) for a request refused before its body is read; None to go on."""
        host = headers.get("host")
        if not self.hosts.allows(host):
            shown = (host or "")[:80]
            return 403, (f"Host '{shown}' is not a name this server answers to (a guard against DNS rebinding): "
                         "open the address it printed, or start it with --allow-host NAME")
        if scope["path"].startswith("/api/"):
            origin, site = headers.get("origin"), headers.get("sec-fetch-site")
            if origin is not None and not self.hosts.allows_origin(origin):
                return 403, "cross-site request refused: the labelling API answers only its own page"
            if site is not None and site not in _SAFE_SITES:
                return 403, "cross-site request refused: the labelling API answers only its own page"
        if scope["method"] not in ("GET", "HEAD"):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, "a write must be sent as Content-Type: application/json"
        if not self.access.open and self.access.token_of(headers, query) is None:
            return 401, "access token missing or wrong: open the address the server printed"
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "Content-Length is not a number"
            if int(length) > self.max_body:
                return 413, f"request body over {self.max_body // 1024} KB"
        return None

    async def read_body(self, receive) -> tuple[bytes, bool]:
        """The whole body, or (what was read, True) as soon as it passes the cap: a chunked body is counted as its
        chunks arrive, and the rest is never read."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", False  # the client left; the app's own receive sees it too
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False
