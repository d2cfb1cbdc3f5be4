"""The labelling server's routes (Starlette): the page, its static files, and a small JSON API over one `Store`.

    GET  /                      the page (plain HTML + JS from static/; nothing fetched from elsewhere)
    GET  /api/me                {annotator}: the person a per-person link names, else null (the page asks a name)
    GET  /api/item?annotator=N  the annotator's current item: {item, token, prompt, a, b, progress} or {done, progress}
    POST /api/judge             {annotator, item, token, choice: a|b|tie|both_bad|skip, harmful: [a|b, ...]}
                                -> {saved: true, next: <as /api/item>}, sent after the judgement is committed
    POST /api/undo              {annotator} -> {next: <as /api/item>}: the annotator's last judgement taken back
    GET  /api/progress          {done, total, annotators: {name: count}}

"a" and "b" are the page's left and right; the server maps them onto the pair through its `swap`, so the page never
learns which model made which response. Before any route, `guard.Guard` refuses what another site could send (a
foreign Host, a cross-site or non-JSON write, a body over the cap) and, with access tokens, a request without one:
as `?token=` (the page's address; the reply sets it as a same-site cookie), the cookie, or an `X-Label-Token`
header. With per-person links, the token names the annotator: a request in another person's name gets 403. A bad
request gets a 4xx with {"error": message} and changes nothing.
"""

from __future__ import annotations

import json
import os

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from rlhfkit.label.guard import COOKIE, Access, Guard, HostAllowList, valid_annotator
from rlhfkit.label.store import Handed, Rejected, Store

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_PAGE_TO_PAIR = {"a": "first", "b": "second", "tie": "tie", "both_bad": "both_bad", "skip": "skip"}
# The page runs only its own script and style: even a response that smuggled markup past textContent could not run.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; object-src 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers=_HEADERS)


async def _body(request: Request) -> dict:
    try:
        data = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise Rejected(400, "malformed body: expected a JSON object") from None
    if not isinstance(data, dict):
        raise Rejected(400, "malformed body: expected a JSON object")
    return data


def _refusing(endpoint):
    """The endpoint, with a `Rejected` answered as its 4xx."""

    async def wrapped(request: Request):
        try:
            return await endpoint(request)
        except Rejected as exc:
            return _error(exc.status, str(exc))

    return wrapped


class Routes:
    """The endpoints over one store (module docstring)."""

    def __init__(self, store: Store, access: Access):
        self.store, self.access = store, access

    def _token(self, request: Request) -> str | None:
        return self.access.token_of({k.lower(): v for k, v in request.headers.items()}, dict(request.query_params))

    def _annotator(self, request: Request, value) -> str:
        """The annotator a request acts as: `value`, which a per-person link must name its own person."""
        if not valid_annotator(value):
            raise Rejected(400, "annotator: expected a name of 1-64 letters, digits, spaces or . _ @ -")
        person = self.access.person(self._token(request))
        if self.access.personal and value != person:
            raise Rejected(403, f"this is {person}'s link: it judges and undoes only as {person}, not as {value!r}")
        return value

    def progress(self, annotator: str | None = None) -> dict:
        p = self.store.progress()
        out = {"done": p.done, "total": p.total, "annotators": p.per_annotator}
        return out if annotator is None else {**out, "mine": p.per_annotator.get(annotator, 0)}

    def payload(self, handed: Handed | None, annotator: str) -> dict:
        """What the page shows: the prompt and the two responses as left (a) and right (b); never their models."""
        if handed is None:
            return {"done": True, "progress": self.progress(annotator)}
        pair = handed.pair
        left, right = (pair.second, pair.first) if pair.swap else (pair.first, pair.second)
        return {"item": handed.item, "token": handed.token, "prompt": pair.prompt, "a": left.content,
                "b": right.content, "progress": self.progress(annotator)}

    async def page(self, request: Request):
        response = FileResponse(os.path.join(STATIC, "index.html"), headers=_HEADERS)
        token = self._token(request)
        if token is not None and request.query_params.get("token") == token:  # the printed address: remember it
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    async def me(self, request: Request):
        return JSONResponse({"annotator": self.access.person(self._token(request))}, headers=_HEADERS)

    async def item(self, request: Request):
        who = self._annotator(request, request.query_params.get("annotator"))
        return JSONResponse(self.payload(await run_in_threadpool(self.store.next_item, who), who), headers=_HEADERS)

    async def judge(self, request: Request):
        data = await _body(request)
        who = self._annotator(request, data.get("annotator"))
        item_id, tok, choice, harmful = (data.get(k) for k in ("item", "token", "choice", "harmful"))
        if not isinstance(item_id, int) or isinstance(item_id, bool) or not isinstance(tok, str):
            raise Rejected(400, "malformed body: 'item' must be an integer and 'token' a string")
        if choice not in _PAGE_TO_PAIR:
            raise Rejected(422, f"unknown choice {choice!r}; expected one of {', '.join(_PAGE_TO_PAIR)}")
        harmful = [] if harmful is None else harmful
        if not isinstance(harmful, list) or any(h not in ("a", "b") for h in harmful):
            raise Rejected(422, "harmful: expected a list of sides, 'a' and/or 'b'")
        # The page's left/right onto the pair's first/second.
        swap = (await run_in_threadpool(self.store.pair, item_id)).swap
        side = {"a": "second" if swap else "first", "b": "first" if swap else "second"}
        pair_choice = side.get(choice, _PAGE_TO_PAIR[choice])
        handed = await run_in_threadpool(self.store.judge, who, item_id, tok, pair_choice, tuple(side[h] for h in harmful))
        return JSONResponse({"saved": True, "next": self.payload(handed, who)}, headers=_HEADERS)

    async def undo(self, request: Request):
        who = self._annotator(request, (await _body(request)).get("annotator"))
        return JSONResponse({"next": self.payload(await run_in_threadpool(self.store.undo, who), who)}, headers=_HEADERS)

    async def progress_route(self, request: Request):
        return JSONResponse(self.progress(), headers=_HEADERS)


def make_app(store: Store, token: str | None = None, *, people: dict[str, str] | None = None,
             hosts: HostAllowList | None = None) -> Starlette:
    """The server for `store`: with `token`, every request must carry it; with `people` ({name: token}), each
    person's own (and acts only as them). `hosts`: the Host names it answers to (default: the loopback's, port 8000,
    as `rlhfkit label` serves by default)."""
    if token is not None and people:
        raise ValueError("give a shared token or per-person tokens, not both")
    access = Access.links(people) if people else Access.single(token)
    r = Routes(store, access)
    routes = [Route("/", _refusing(r.page)), Route("/api/me", _refusing(r.me)), Route("/api/item", _refusing(r.item)),
              Route("/api/judge", _refusing(r.judge), methods=["POST"]),
              Route("/api/undo", _refusing(r.undo), methods=["POST"]), Route("/api/progress", _refusing(r.progress_route)),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    guard = Middleware(Guard, hosts=hosts or HostAllowList.serving("127.0.0.1", 8000), access=access)
    return Starlette(routes=routes, middleware=[guard])
