"""`rlhfkit label`: make the candidates once, then serve the page; or, given --export, --export-flags, --figures or
--result, read the database (also while a server writes to it) and write files.

Bad configuration is a `UserError` (one line, exit 2) before any model loads where it can be: an address other than
the loopback without a way to reach it safely, a port in use, a database that cannot be written or was made for
other candidates, a prompts or candidates file without prompts.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlencode

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text
from rlhfkit.label.candidates import SamplingSpec, fingerprint, file_digest, make_pairs, read_candidates, sample_groups
from rlhfkit.label.export import flag_rows, preference_rows, write_jsonl
from rlhfkit.label.guard import HostAllowList, valid_annotator
from rlhfkit.label.store import Store

logger = logging.getLogger("rlhfkit")


@dataclass(frozen=True)
class LabelOptions:
    """`rlhfkit label`'s command line (see `rlhfkit label --help`)."""

    db: str
    candidates: str | None = None
    model: str | None = None
    compare: str | None = None
    prompts: str | None = None
    config: str | None = None
    overrides: tuple[str, ...] = ()
    num_samples: int | None = None
    seed: int = 0
    batch_size: int = 8
    max_prompts: int | None = None
    overlap: float = 0.0
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    allow_host: tuple[str, ...] = ()  # more Host names to answer to (a proxy's, another name of this machine)
    annotators: tuple[str, ...] = ()  # one link each, with its own token
    lease: float = 30.0  # minutes an open item stays its annotator's before another may take it
    export: str | None = None
    export_flags: str | None = None
    figures: str | None = None
    result: str | None = None
    reward_model: str | None = None

    @property
    def reads(self) -> bool:
        return any((self.export, self.export_flags, self.figures, self.result))


def run_label(opts: LabelOptions) -> None:
    if opts.reward_model and not (opts.figures or opts.result):
        raise UserError("--reward-model is read by --figures (its accuracy on the labels) or --result (its scores)")
    if opts.reads:
        making = [f"--{name.replace('_', '-')}" for name in ("candidates", "model", "compare", "prompts", "config", "token",
                                                             "num_samples", "max_prompts", "allow_host", "annotators")
                  if getattr(opts, name) not in (None, ())]
        if making or opts.overrides:
            raise UserError(f"--export, --export-flags, --figures and --result read an existing --db: "
                            f"{', '.join(making) or opts.overrides[0]} does not apply")
        return read_outputs(opts)
    serve_labels(opts)


def check_serving(opts: LabelOptions) -> tuple[HostAllowList, str | None]:
    """The serving options, checked before anything loads (the pipeline checks a label stage's with the whole file):
    overlap, lease, the Host allow-list, the annotators' names and the token. Returns the allow-list and the token every
    request must carry (none with --annotators: each link carries its own)."""
    if not 0.0 <= opts.overlap <= 1.0:
        raise UserError(f"--overlap must be a share in [0, 1], got {opts.overlap}")
    if opts.lease <= 0:
        raise UserError(f"--lease must be a positive number of minutes, got {opts.lease}")
    hosts = host_allow_list(opts)
    check_annotators(opts)
    return hosts, None if opts.annotators else access_token(opts.host, opts.token)


def serve_labels(opts: LabelOptions, until_done_poll_s: float | None = None) -> Store:
    """`rlhfkit label` and the pipeline's `label` stage: the options and the port checked before any model loads, the
    items made once (`prepare`; a restart resumes them), the page served until Ctrl-C; with `until_done_poll_s`, served
    only while an item is left, in a thread, this one returning (with the store) once every item is judged, looking
    every so many seconds. A waiting run whose items are all judged already needs no free port."""
    hosts, token = check_serving(opts)
    waiting = until_done_poll_s is not None
    if not (waiting and _all_judged(opts.db)):
        check_port_free(opts.host, opts.port)
    store = Store(opts.db, lease_s=60 * opts.lease)
    prepare(store, opts)
    if not (waiting and _all_judged(opts.db, store)):  # an interrupted wait may have ended with the last judgement
        serve(store, opts, hosts, token, person_links(store, opts.annotators), until_done_poll_s)
    return store


def _all_judged(db: str, store: Store | None = None) -> bool:
    """Every item of the database `db` (or of the open `store`) judged as often as it needs."""
    if store is None:
        if not os.path.isfile(db):
            return False
        store = Store(db)
        p = store.progress()
        store.close()
    else:
        p = store.progress()
    return 0 < p.total <= p.done


# 1. Candidates ---------------------------------------------------------------------------------------------------


def generation_config(opts: LabelOptions):
    """The sampling settings: the `generation` section of --config (a stage's YAML), then generation.* overrides,
    then -k; any other override is refused."""
    from rlhfkit.config import GenerationConfig
    from rlhfkit.config.fields import load_config, read_yaml

    wrong = [o for o in opts.overrides if not o.startswith("generation.")]
    if wrong:
        raise UserError(f"override '{wrong[0]}': rlhfkit label takes only generation.* overrides")
    section = read_yaml(opts.config).get("generation", {}) if opts.config else {}
    overrides = [o.removeprefix("generation.") for o in opts.overrides]
    k = opts.num_samples if opts.num_samples is not None else (1 if opts.compare else 2)
    cfg = load_config(GenerationConfig, None, overrides + [f"num_samples={k}"], defaults=section)
    if opts.compare is None and cfg.num_samples < 2:
        raise UserError(f"-k {cfg.num_samples}: collecting preferences needs at least 2 responses per prompt")
    return cfg


def prepare(store: Store, opts: LabelOptions) -> None:
    """Stores the items once: from --candidates, or sampled from --model (and --compare); a restart with the same
    inputs reuses them without sampling again."""
    if (opts.candidates is None) == (opts.model is None):
        raise UserError("give the candidates: --candidates FILE, or --model MODEL --prompts FILE (with --compare "
                        "MODEL for a blind comparison)")
    if opts.candidates is not None:
        if opts.compare or opts.prompts:
            raise UserError("--candidates takes ready-made responses: --model, --compare and --prompts do not apply")
        spec = {"candidates": file_digest(opts.candidates) if os.path.isfile(opts.candidates) else opts.candidates}
        source, mode = f"candidates file {opts.candidates}", "collect"
    else:
        if not opts.prompts:
            raise UserError("--model needs --prompts FILE (the prompts to sample responses to)")
        sampling = SamplingSpec(opts.model, opts.prompts, generation_config(opts), opts.compare, opts.seed,
                                opts.batch_size, opts.max_prompts)
        spec = sampling.as_dict()
        source = f"{opts.model} vs {opts.compare}" if opts.compare else f"{opts.model} on {opts.prompts}"
        mode = "compare" if opts.compare else "collect"
    spec = {**spec, "overlap": opts.overlap, "seed": opts.seed}
    if store.check_made_for(fingerprint(spec), source):
        logger.info("%s: %d items already stored; resuming", store.path, store.progress().total)
        return
    groups = read_candidates(opts.candidates) if opts.candidates else sample_groups(sampling)
    store.create(make_pairs(groups, opts.overlap, opts.seed), fingerprint(spec), source, mode)


# 2. Serving ------------------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def access_token(host: str, token: str | None) -> str | None:
    """The token every request must carry: --token, or a fresh random one when the server listens beyond this
    machine (any address but the loopback); none on the loopback unless given."""
    if token is not None and len(token) < 16:
        raise UserError("--token must be at least 16 characters (or leave it out for a random one)")
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(24)
    return token


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn binds: a port left in TIME_WAIT by a killed server is free, one that something listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): the port is in use or the "
                            "address is not this machine's; pass --port") from None


def check_annotators(opts: LabelOptions) -> None:
    for i, name in enumerate(opts.annotators):
        if not valid_annotator(name):
            raise UserError(f"--annotators: expected names of 1-64 letters, digits, spaces or . _ @ -, separated by "
                            f"commas; got {name!r}")
        if name in opts.annotators[:i]:
            raise UserError(f"--annotators: {name!r} is named twice")
    if opts.annotators and opts.token is not None:
        raise UserError("--token does not apply with --annotators: each person's link carries its own token")


def person_links(store: Store, annotators: tuple[str, ...]) -> dict[str, str]:
    """{name: token} for --annotators: each token derived from the database's own secret and the name, so that a
    restart prints the same links and nobody can make one from a name alone."""
    if not annotators:
        return {}
    secret = store.secret("link_secret").encode()
    return {name: base64.urlsafe_b64encode(hmac.digest(secret, name.encode(), "sha256")).decode()[:32]
            for name in annotators}


def printed_names(host: str) -> tuple[str, ...]:
    """The names a colleague opens the page under, beyond the loopback: listening on every address, this machine's
    name and the address it reaches the network from (without sending anything); else the address itself."""
    if host not in ("0.0.0.0", "::"):
        return () if is_loopback(host) else (host,)
    names = [socket.gethostname()]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: a route is chosen, no packet leaves
            names.append(s.getsockname()[0])
        except OSError:
            pass  # no network: the name only
    return tuple(n for n in names if n and not is_loopback(n))


def host_allow_list(opts: LabelOptions) -> HostAllowList:
    try:
        return HostAllowList.serving(opts.host, opts.port, printed_names(opts.host), opts.allow_host)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def serve(store: Store, opts: LabelOptions, hosts: HostAllowList, token: str | None, people: dict[str, str],
          until_done_poll_s: float | None = None) -> None:
    """The banner (the links to open, the Host names answered) and the page: until Ctrl-C, or, with
    `until_done_poll_s`, until every item is judged (`_serve_until_done`)."""
    try:
        import uvicorn

        from rlhfkit.label.app import make_app
    except ImportError as exc:
        raise UserError(f"rlhfkit label's server needs starlette and uvicorn ({exc}): pip install 'rlhfkit[label]'") from None

    p, host, port = store.progress(), opts.host, opts.port
    names = printed_names(host)
    shown = names[0] if host in ("0.0.0.0", "::") and names else f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/"
    if people:
        print(f"rlhfkit label: {p.done}/{p.total} judgements made; one link per person (each judges and undoes only "
              "as themself):", flush=True)
        for name, tok in people.items():
            print(f"  {name}: {address}?{urlencode({'token': tok})}", flush=True)
    else:
        print(f"rlhfkit label: {p.done}/{p.total} judgements made; open {address}" + (f"?token={token}" if token else ""),
              flush=True)
    print(f"rlhfkit label: answers to Host {', '.join(hosts.hosts)} (others with --allow-host)", flush=True)
    app = make_app(store, token, people=people, hosts=hosts)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    if until_done_poll_s is None:
        server.run()
    else:
        _serve_until_done(server, store, until_done_poll_s)


def _serve_until_done(server, store: Store, poll_s: float) -> None:
    """The server in a thread while this one waits for the last judgement, printing the count as it moves; a server
    that stops (its port taken since it was checked) ends the wait with one line instead of leaving it forever."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    print("rlhfkit label: waiting until every item is judged (Ctrl-C stops; the same command picks up where the labels "
          "are)", flush=True)
    try:
        last = store.progress().done
        while (p := store.progress()).done < p.total:
            if not thread.is_alive():
                raise UserError(f"the labelling server on {server.config.host}:{server.config.port} stopped with "
                                f"{p.done}/{p.total} judgements made (its output is above); the same command resumes")
            if p.done != last:
                print(f"rlhfkit label: {p.done}/{p.total}", flush=True)
                last = p.done
            time.sleep(poll_s)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# 3. Reading the database -----------------------------------------------------------------------------------------


def read_outputs(opts: LabelOptions) -> None:
    from rlhfkit.label.figures import agreement, per_annotator, plot_figures  # torch: not on the server's start

    if not os.path.isfile(opts.db):
        raise UserError(f"database '{opts.db}' does not exist")
    store = Store(opts.db)
    if opts.result and store.meta("mode") != "compare":
        raise UserError(f"--result needs a compare-mode database (--compare); '{opts.db}' collects preferences")
    judgements = store.judgements()
    if opts.export:
        rows = preference_rows(judgements)
        print(f"{write_jsonl(rows, opts.export)}: {len(rows)} preference pairs")
    if opts.export_flags:
        flags = flag_rows(judgements)
        print(f"{write_jsonl(flags, opts.export_flags)}: {sum(f['harmful'] for f in flags)} of {len(flags)} responses "
              "flagged harmful")
    if opts.figures:
        os.makedirs(opts.figures, exist_ok=True)
        rows = preference_rows(judgements)
        accuracy = None
        scored = paired_scores(opts.reward_model, rows) if opts.reward_model and rows else []
        if scored:  # as the reward stage's accuracy: a tie counts as wrong
            accuracy = sum(c > r for c, r in scored) / len(scored)
        counts, agree = per_annotator(judgements), agreement(judgements)
        figures = {"per_annotator": counts, "agreement": dataclasses.asdict(agree), "reward_model": opts.reward_model,
                   "reward_model_accuracy": accuracy, "pairs": len(rows),
                   "reward_model_pairs": len(scored)}  # pairs with an empty response have no score
        atomic_write_text(os.path.join(opts.figures, "label_figures.json"), json.dumps(figures, indent=2) + "\n")
        print(plot_figures(counts, agree, os.path.join(opts.figures, "label_figures.png"), accuracy))
    if opts.result:
        print(write_result(judgements, opts.result, opts.reward_model))


def write_result(judgements, out_dir: str, reward_model: str | None) -> str:
    """human_eval.json in `out_dir` (beside `rlhfkit eval`'s eval.json): the human win rate, its interval and tie
    rate; the judges' win rates from eval.json when it is there; the reward model's mean score of both models' responses
    on the same pairs and its own win rate, with the alarm when it prefers what people do not. The reward model reads the
    stored texts as a reward source reads text (`reward_scores`), where `rlhfkit eval` scores the sampled ids when the
    reward model shares the policy's tokenizer: the two can differ where re-tokenising the text does not give them back."""
    from rlhfkit.label.figures import human_win_rate, reward_disagrees

    try:
        human = human_win_rate(judgements)
    except ValueError as exc:
        raise UserError(f"--result: {exc}") from None
    result = {**dataclasses.asdict(human), "skips": sum(j.choice == "skip" for j in judgements)}
    eval_json = os.path.join(out_dir, "eval.json")
    if os.path.isfile(eval_json):
        with open(eval_json, encoding="utf-8") as f:
            result["judge_win_rate"] = json.load(f).get("win_rate", {})
    rm_rate = None
    if reward_model:
        judged = {j.item: j.pair for j in judgements}  # each pair once, model's response first
        rows = [{"prompt": p.prompt, "chosen": p.first.content, "rejected": p.second.content} for p in judged.values()]
        scored = paired_scores(reward_model, rows)
        if scored:
            rm_rate = sum((a > b) + 0.5 * (a == b) for a, b in scored) / len(scored)
            result["reward_model"] = {"path": reward_model, "pairs": len(scored), "win_rate": rm_rate,
                                      "mean_score": {"model": sum(a for a, _ in scored) / len(scored),
                                                     "reference": sum(b for _, b in scored) / len(scored)}}
    alarm = reward_disagrees(human, rm_rate)
    result["alarms"] = [{"name": "reward_disagrees_with_people", "message": alarm}] if alarm else []
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "human_eval.json")
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    lo, hi = human.interval
    return (f"{path}: {human.model} vs {human.reference}: human win rate {human.win_rate:.3f} "
            f"(95% CI {lo:.3f}-{hi:.3f}), tie rate {human.tie_rate:.3f}, n={human.n}"
            + "".join(f"\nalarm: {a['message']}" for a in result["alarms"]))


def reward_scores(path: str, texts: list[tuple]) -> list[float | None]:
    """A reward model's score of each (prompt, response), through the reward-source protocol (`rewards.RewardModelSource`
    reading text in its own tokens, as it reads a policy's rows in training): a text prompt and response become a user
    and an assistant turn when the reward model's tokenizer has a chat template. An empty response gets None: there is
    nothing to score."""
    from rlhfkit.config import ModelConfig
    from rlhfkit.evaluation.judges import verdicts
    from rlhfkit.models import load_tokenizer
    from rlhfkit.reward_functions import RewardInputs
    from rlhfkit.rewards import load_reward_model_source

    tokenizer = load_tokenizer(ModelConfig(name_or_path=path))
    source = load_reward_model_source(path, tokenizer, path, batch_size=16, tokenizer=tokenizer, reads_text=True)
    chat = bool(getattr(tokenizer, "chat_template", None))
    scored = [i for i, (_, response) in enumerate(texts) if response]
    prompts = [texts[i][0] for i in scored]
    responses = [texts[i][1] for i in scored]
    if chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        responses = [[{"role": "assistant", "content": r}] if isinstance(r, str) else r for r in responses]
    out: list[float | None] = [None] * len(texts)
    if scored:
        inputs = RewardInputs(prompts=prompts, completions=responses, completion_ids=[[] for _ in scored])
        for i, score in zip(scored, verdicts(source, None, inputs)):
            out[i] = score
    return out


def paired_scores(path: str, rows: list[dict]) -> list[tuple[float, float]]:
    """The reward model's (chosen, rejected) scores of each row that has both (`reward_scores`)."""
    flat = reward_scores(path, [(r["prompt"], r[side]) for r in rows for side in ("chosen", "rejected")])
    return [(c, r) for c, r in zip(flat[::2], flat[1::2]) if c is not None and r is not None]


# 4. The command line ---------------------------------------------------------------------------------------------


def add_label_parser(sub) -> None:
    """`rlhfkit label`'s arguments, on the CLI's subcommand parsers."""
    p = sub.add_parser("label", help="collect human preferences (or a blind comparison of two models) in a local web page",
                       description="rlhfkit label: people compare two responses to a prompt in a local web page; "
                                   "export the judgements as preference data, a blind human win rate, or harmful flags")
    p.add_argument("--db", required=True, metavar="FILE", help="the labelling database (SQLite), made on first use")
    what = p.add_argument_group("candidates (stored once in --db; a restart reuses them)")
    what.add_argument("--candidates", metavar="FILE", help="ready-made responses: JSON lines {prompt, responses[, models]}")
    what.add_argument("--model", metavar="MODEL", help="sample responses from this run directory or hub name")
    what.add_argument("--compare", metavar="MODEL", help="blind comparison: --model against this model, same prompts")
    what.add_argument("--prompts", metavar="FILE", help="the prompts to sample (any prompt format rlhfkit reads)")
    what.add_argument("-k", "--num-samples", type=int, help="responses per prompt (default 2; 1 with --compare)")
    what.add_argument("--config", metavar="FILE", help="a stage's YAML file whose generation section sets the sampling")
    what.add_argument("--seed", type=int, default=0, help="sampling seed and the order of sides and overlap (default 0)")
    what.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch (default 8)")
    what.add_argument("--max-prompts", type=int, help="use only the first N prompts")
    what.add_argument("--overlap", type=float, default=0.0,
                      help="share of items two annotators judge, for agreement (default 0: each item once)")
    what.add_argument("overrides", nargs="*", metavar="generation.key=value", help="sampling settings")
    srv = p.add_argument_group("the server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other needs a token)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--token", help="access token every request must carry (default: random beyond the loopback)")
    srv.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                     help="also answer requests for this Host (a proxy's name, another name of this machine); "
                          "repeatable. By default only the address it listens on, localhost, 127.0.0.1, [::1] and "
                          "the names it prints")
    srv.add_argument("--annotators", metavar="NAME,NAME,...",
                     help="a shared server: print one link per person, each with its own token; each judges and "
                          "undoes only as themself")
    srv.add_argument("--lease", type=float, default=30.0, metavar="MINUTES",
                     help="an item left open this long may go to another annotator (default 30)")
    out = p.add_argument_group("outputs (no server; works while one runs)")
    out.add_argument("--export", metavar="FILE", help="preference pairs as JSON lines for rlhfkit rm / dpo")
    out.add_argument("--export-flags", metavar="FILE", help="each response seen, flagged harmful or not, as JSON lines "
                                                            "(rlhfkit eval's red_team.human_flags)")
    out.add_argument("--figures", metavar="DIR", help="label_figures.png/.json: judgements per annotator, agreement")
    out.add_argument("--result", metavar="DIR", help="compare mode: human_eval.json in DIR (beside eval.json)")
    out.add_argument("--reward-model", metavar="DIR", help="with --figures: its accuracy on the human labels; with "
                                                           "--result: its scores of the same samples")


def options_from(args) -> LabelOptions:
    own = ("overrides", "num_samples", "allow_host", "annotators")
    names = [f.name for f in dataclasses.fields(LabelOptions) if f.name not in own]
    annotators = () if args.annotators is None else tuple(n.strip() for n in args.annotators.split(","))
    return LabelOptions(**{n: getattr(args, n) for n in names}, overrides=tuple(args.overrides),
                        num_samples=args.num_samples, allow_host=tuple(args.allow_host), annotators=annotators)
