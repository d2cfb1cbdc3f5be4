"""The pipeline's run: the whole file resolved and validated first, then every stage in order with its gate, skipped
when done with the same effective config, resumed when interrupted; `iterations` rounds with the capability check and
rollback; one state file (`pipeline.json`) and one report.

Resumability rests on one fingerprint per stage: the hash of its effective config (the wiring included) chained with
every earlier stage's fingerprint, so a change anywhere reruns everything after it. A finished stage writes its
fingerprint and figures to `<its folder>/pipeline_stage.json`; `pipeline.json` at the root records every stage as it
starts and ends. Nothing a user wrote is replaced: a stage folder the pipeline has no record of must be absent or
empty, and a root file the pipeline writes (report.html, frontier.png, pipeline.json) must be its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, check_writable
from rlhfkit.pipeline import gates as gates_
from rlhfkit.pipeline import steps
from rlhfkit.pipeline.resolve import POLICY_STAGES, Resolved, Upstream, produced, resolve
from rlhfkit.pipeline.spec import JUDGE, LABEL, PYTHON, PipelineSpec, StageSpec

STATE = "pipeline.json"
MARKER = "pipeline_stage.json"
OWN_FILES = (STATE, "report.html", "frontier.png")


@dataclass
class StageRecord:
    """One stage as this run saw it (pipeline.json's `stages`, the report's rows)."""

    name: str
    stage: str
    dir: str
    round: int
    status: str  # "ran", "resumed", "skipped" (done before, same config), "failed"
    fingerprint: str
    figures: dict = field(default_factory=dict)
    gate: list = field(default_factory=list)  # [Verdict as dict]
    wires: list = field(default_factory=list)  # ["key <- source (value)"]
    seconds: float = 0.0


@dataclass
class PipelineResult:
    """What `rlhfkit.pipeline(...)` returns."""

    output_dir: str
    stages: list[StageRecord]
    failed_gates: list[dict]  # every failed verdict (with --continue-past-gates: the run went on)
    rounds: list[dict]  # per round: {"round", "capability_loss_nats", "rolled_back"}
    report: str  # report.html's path


def fingerprint(r: Resolved, previous: str) -> str:
    """The hash of the stage's kind and effective keys, chained with the stages before it."""
    data = r.data if r.stage != PYTHON else {"run": r.cfg["run"], "args": r.cfg["args"]}
    text = json.dumps({"stage": r.stage, "dir": r.dir, "data": data, "previous": previous}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Runner:
    def __init__(self, spec: PipelineSpec, from_stage: str | None = None, continue_past_gates: bool = False,
                 plan: bool = True):
        self.spec, self.root, self.continue_past_gates, self.plan = spec, spec.output_dir, continue_past_gates, plan
        if from_stage is not None:
            spec.stage(from_stage)  # a ConfigError naming the stages when it is not one
        self.from_stage = from_stage
        self.records: list[StageRecord] = []
        self.rounds: list[dict] = []
        self.failed: list[dict] = []
        self.dirs: dict[str, str] = {}
        self.state = self._read_state()
        self.rerunning = False

    # Before anything runs -----------------------------------------------------------------------------------------

    def _read_state(self) -> dict:
        check_writable(self.root, "output_dir")
        path = os.path.join(self.root, STATE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        mine = [n for n in OWN_FILES if os.path.exists(os.path.join(self.root, n))]
        if mine:
            raise UserError(f"output_dir '{self.root}' holds {mine[0]} but no {STATE}: it is not this pipeline's; "
                            "choose another output_dir (nothing a user wrote is replaced)")
        return {"stages": {}}

    def check_all(self) -> list[Resolved]:
        """Every stage of every round resolved and validated, as if no round were rolled back, and every stage's folder
        checked: the whole file checked before the first stage runs. Returns round 1's stages."""
        up, first = Upstream(), []
        for r in self.order():
            spec, round_ = r
            resolved = resolve(spec, up, self.root, round_, f"{self.spec.path}: {spec.where}")
            gates_.effective_gate(self._default_gate(resolved, up), spec.gate, f"{self.spec.path}: {spec.where}")
            up = produced(resolved, up)
            if round_ == 1:
                first.append(resolved)
            self.check_folder(resolved)
        return first

    def check_folder(self, r: Resolved) -> None:
        """A stage folder the pipeline has no record of must be absent or empty: a user's files are never replaced."""
        held = os.path.isdir(r.dir) and bool(os.listdir(r.dir))
        if held and r.dir not in self.state["stages"] and self._marker(r.dir) is None:
            raise UserError(f"stage '{r.name}': its folder '{r.dir}' holds files the pipeline did not write; move "
                            "them or choose another output_dir (nothing a user wrote is replaced)")

    def order(self) -> list[tuple[StageSpec, int]]:
        """(stage, round) in run order: the stages before the round block once, the block `iterations` times, the
        stages after it once."""
        stages = list(self.spec.stages)
        marked = [i for i, s in enumerate(stages) if s.round]
        if not marked:
            return [(s, 1) for s in stages]
        lo, hi = marked[0], marked[-1]
        if len(marked) != hi - lo + 1:
            raise UserError(f"{self.spec.path}: the stages marked `round: true` must follow one another "
                            f"({', '.join(stages[i].name for i in marked)})")
        block = stages[lo : hi + 1]
        rounds = [(s, r) for r in range(1, self.spec.iterations + 1) for s in block]
        return [(s, 1) for s in stages[:lo]] + rounds + [(s, 1) for s in stages[hi + 1 :]]

    @staticmethod
    def _default_gate(r: Resolved, up: Upstream) -> dict[str, str]:
        return gates_.default_gate(r.stage, r.cfg, evaluates_policy=r.stage == "eval" and up.policy is not None
                                   and up.reference is not None)

    # Running ------------------------------------------------------------------------------------------------------

    def run(self) -> PipelineResult:
        first = self.check_all()
        self.print_wiring(first)
        if self.plan:
            from rlhfkit.pipeline.planning import check_fits

            check_fits(self.spec.path, first, self.spec.device, self.spec.memory_gb)
        os.makedirs(self.root, exist_ok=True)
        up, block_start = Upstream(), None
        for spec, round_ in self.order():
            if spec.round and spec is self._block()[0]:
                block_start = up.copy()
            where = f"{self.spec.path}: {spec.where}"
            r = resolve(spec, up, self.root, round_, where)
            up = self.step(r, up)
            if spec.round and spec is self._block()[-1]:
                up = self.after_round(round_, block_start, up)
        return self.finish()

    def _block(self) -> list[StageSpec]:
        return [s for s in self.spec.stages if s.round]

    def step(self, r: Resolved, up: Upstream) -> Upstream:
        """Run (or skip) one stage, check its gate; the Upstream after it."""
        fp = fingerprint(r, up.fingerprint)
        self.dirs[r.spec.name if r.round == 1 else f"{r.spec.name}_round_{r.round}"] = r.dir
        self.rerunning = self.rerunning or (self.from_stage == r.spec.name)
        mode = self.mode(r, fp)
        record = StageRecord(r.name, r.stage, r.dir, r.round, "skipped" if mode == "skip" else
                             "resumed" if mode == "resume" else "ran", fp, wires=[str(w) for w in r.wires])
        print(f"\n=== {r.name} ({r.stage}): {'skipped, done with the same config' if mode == 'skip' else mode} ===",
              flush=True)
        t0 = time.time()
        if mode == "skip":
            record.figures = self._marker(r.dir)["figures"]
        else:
            self._save_state(r, fp, "started")
            record.figures = steps.run(r, mode, self.root, self.dirs, self.spec.vars)
            record.seconds = time.time() - t0
            atomic_write_text(os.path.join(r.dir, MARKER), json.dumps(
                {"fingerprint": fp, "figures": record.figures, "stage": r.stage, "seconds": record.seconds}, indent=2))
            self._save_state(r, fp, "done")
        self.records.append(record)
        self.check_gate(r, up, record)
        nxt = produced(r, up)
        nxt.fingerprint = fp
        return nxt

    def mode(self, r: Resolved, fp: str) -> str:
        """skip (done, same fingerprint), resume (interrupted with a checkpoint), replace (the pipeline's own earlier
        run) or fresh; a folder the pipeline has no record of must be absent or empty."""
        marker = self._marker(r.dir)
        known = self.state["stages"].get(r.dir)
        if marker and marker.get("fingerprint") == fp and not self.rerunning:
            return "skip"
        if not (os.path.isdir(r.dir) and os.listdir(r.dir)):
            return "fresh"
        self.check_folder(r)
        if known and known["fingerprint"] == fp and known["state"] == "started" and not self.rerunning:
            from rlhfkit.checkpoint import latest_checkpoint

            if r.stage not in ("eval", LABEL, JUDGE, PYTHON) and latest_checkpoint(r.dir) is not None:
                return "resume"
            if r.stage in (LABEL, PYTHON):
                return "resume"  # the label store resumes itself; a python stage is told it was interrupted
        return "replace"

    def _marker(self, folder: str) -> dict | None:
        path = os.path.join(folder, MARKER)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _save_state(self, r: Resolved, fp: str, state: str) -> None:
        self.state["stages"][r.dir] = {"name": r.name, "fingerprint": fp, "state": state}
        self.write_state()

    def write_state(self) -> None:
        self.state.update(records=[dataclasses.asdict(s) for s in self.records], rounds=self.rounds,
                          failed_gates=self.failed)
        atomic_write_text(os.path.join(self.root, STATE), json.dumps(self.state, indent=2, default=str))

    def check_gate(self, r: Resolved, up: Upstream, record: StageRecord) -> None:
        where = f"{self.spec.path}: {r.spec.where}"
        gate = gates_.effective_gate(self._default_gate(r, up), r.spec.gate, where)
        verdicts = gates_.check(r.name, gate, record.figures)
        record.gate = [{**dataclasses.asdict(v), "suggestion": v.suggestion} for v in verdicts]
        for v in verdicts:
            print("  " + v.line(), flush=True)
        failed = [v for v in verdicts if not v.passed]
        self.failed += [{**dataclasses.asdict(v), "suggestion": v.suggestion} for v in failed]
        if failed and not self.continue_past_gates:
            self.finish()
            v = failed[0]
            raise gates_.GateFailed(f"{v.line()}. The seeds suggest: {v.suggestion}. (Change the stage and run the "
                                    f"same command, or pass --continue-past-gates to run on.)")

    # Rounds -------------------------------------------------------------------------------------------------------

    def after_round(self, round_: int, start: Upstream, up: Upstream) -> Upstream:
        """The capability check after a round: the round's policy against the policy it started from, on the
        capability data (`rlhfkit eval`'s alignment-tax block); a loss over the bound rolls the round back."""
        cap = self.spec.capability
        info = {"round": round_, "policy": up.policy and up.policy[1], "rolled_back": False,
                "capability_loss_nats": None}
        if cap is None or up.policy is None:
            self.rounds.append(info)
            return dataclasses.replace(up, start=up.policy or up.start)
        start_policy = start.start or start.sft
        check = _capability_spec(cap, round_)
        # The eval's wiring compares the round's policy with its reference: the policy the round started from.
        self.step(resolve(check, up, self.root, round_, f"{self.spec.path}: capability check"), up)
        loss = self.records[-1].figures.get("alignment_tax/delta_nats")
        info["capability_loss_nats"] = loss
        if loss is None or loss <= cap.max_loss_nats:
            up = dataclasses.replace(up, start=up.policy)
        else:
            info.update(rolled_back=True, restored=start_policy[1])
            print(f"  round {round_} ROLLED BACK: capability loss {loss:.4f} nats/token > {cap.max_loss_nats}; the "
                  f"next round starts from {start_policy[1]}. {gates_.SUGGESTIONS['alignment_tax/delta_nats']}",
                  flush=True)
            up = dataclasses.replace(up, policy=start.policy, reference=start.reference)
        self.rounds.append(info)
        self.write_state()
        return up

    # The end ------------------------------------------------------------------------------------------------------

    def print_wiring(self, first: list[Resolved]) -> None:
        print(f"pipeline {self.spec.path}: {len(self.order())} stages under {self.root}", flush=True)
        for r in first:
            for w in r.wires:
                if w.key != "output_dir":
                    print(f"  {r.name}: {w}", flush=True)

    def finish(self) -> PipelineResult:
        from rlhfkit.pipeline.report import write_pipeline_report

        self.write_state()
        result = PipelineResult(self.root, self.records, self.failed, self.rounds,
                                os.path.join(self.root, "report.html"))
        write_pipeline_report(result)
        return result


def _capability_spec(cap, round_: int) -> StageSpec:
    from rlhfkit.config.fields import merge

    keys = merge({"data": {"eval": cap.data}, "capability_data": cap.data, "max_prompts": 8}, cap.config)
    return StageSpec(index=0, name="capability", stage="eval", config=keys, gate=False)
