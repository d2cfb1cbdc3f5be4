"""The labelling server's routes (Starlette): the page, its static files, and a small JSON API over one `Store`.

    GET  /                      the page (plain HTML + JS from static/; nothing fetched from elsewhere)
    GET  /api/item?annotator=N  the annotator's current item: {item, token, prompt, a, b, progress} or {done, progress}
    POST /api/judge             {annotator, item, token, choice: a|b|tie|both_bad|skip, harmful: [a|b, ...]}
                                -> {saved: true, next: <as /api/item>}, sent after the judgement is committed
    POST /api/undo              {annotator} -> {next: <as /api/item>}: the last judgement taken back
    GET  /api/progress          {done, total, annotators: {name: count}}

"a" and "b" are the page's left and right; the server maps them onto the pair through its `swap`, so the page never
learns which model made which response. With an access token, every request must carry it: as `?token=` (the page's
address; the reply sets it as a same-site cookie), the cookie, or an `X-Label-Token` header. A bad request gets a 4xx
with {"error": message} and changes nothing.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from http.cookies import SimpleCookie

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from rlhfkit.label.store import Handed, Rejected, Store

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
COOKIE = "rlhfkit_label_token"
_ANNOTATOR = re.compile(r"^[\w.@ -]{1,64}$")
_PAGE_TO_PAIR = {"a": "first", "b": "second", "tie": "tie", "both_bad": "both_bad", "skip": "skip"}
# The page runs only its own script and style: even a response that smuggled markup past textContent could not run.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; object-src 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


class TokenCheck:
    """ASGI middleware: with a token, any request without it (query, cookie or header) gets 401."""

    def __init__(self, app, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http" or self._carries_token(scope):
            return await self.app(scope, receive, send)
        response = JSONResponse({"error": "access token missing or wrong: open the address the server printed"}, 401)
        await response(scope, receive, send)

    def _carries_token(self, scope) -> bool:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        query = dict(p.partition("=")[::2] for p in scope.get("query_string", b"").decode("latin-1").split("&") if p)
        cookie = SimpleCookie(headers.get("cookie", ""))
        given = [headers.get("x-label-token"), query.get("token"), cookie[COOKIE].value if COOKIE in cookie else None]
        return any(g is not None and hmac.compare_digest(g.encode(), self.token.encode()) for g in given)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers=_HEADERS)


def _annotator(value) -> str:
    if not isinstance(value, str) or not _ANNOTATOR.match(value):
        raise Rejected(400, "annotator: expected a name of 1-64 letters, digits, spaces or . _ @ -")
    return value


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

    def __init__(self, store: Store, token: str | None):
        self.store, self.token = store, token

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
        if self.token is not None and "token" in request.query_params:
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        return response

    async def item(self, request: Request):
        who = _annotator(request.query_params.get("annotator"))
        return JSONResponse(self.payload(await run_in_threadpool(self.store.next_item, who), who), headers=_HEADERS)

    async def judge(self, request: Request):
        data = await _body(request)
        who = _annotator(data.get("annotator"))
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
        who = _annotator((await _body(request)).get("annotator"))
        return JSONResponse({"next": self.payload(await run_in_threadpool(self.store.undo, who), who)}, headers=_HEADERS)

    async def progress_route(self, request: Request):
        return JSONResponse(self.progress(), headers=_HEADERS)


def make_app(store: Store, token: str | None = None) -> Starlette:
    """The server for `store`; with `token`, every request must carry it."""
    r = Routes(store, token)
    routes = [Route("/", _refusing(r.page)), Route("/api/item", _refusing(r.item)),
              Route("/api/judge", _refusing(r.judge), methods=["POST"]),
              Route("/api/undo", _refusing(r.undo), methods=["POST"]), Route("/api/progress", _refusing(r.progress_route)),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    app = Starlette(routes=routes)
    app.add_middleware(TokenCheck, token=token)
    return app
