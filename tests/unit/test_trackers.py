"""The tracker sinks with the real packages, offline: what each writes is read back with the tracker's own reader
(W&B: its protobuf records in the offline run's .wandb file; TensorBoard: EventAccumulator; trackio: its Api)."""

import glob
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

from rlhfkit.errors import UserError
from rlhfkit.trackers import TRACKERS, check_trackers, flat_config

CONFIG = {"stage": "grpo", "seed": 3, "optim": {"lr": 0.1, "scheduler": "linear"}, "reward": {"model": [], "clip": None}}
ROWS = [{"prompt": "Rate it:", "completion": "great | fine\nreally", "reward": 0.5},
        {"prompt": "Say hi", "completion": "hi", "reward": -1.25}]


def test_flat_config_keeps_scalars_and_writes_the_rest_as_json():
    assert flat_config(CONFIG) == {"stage": "grpo", "seed": 3, "optim.lr": 0.1, "optim.scheduler": "linear",
                                   "reward.model": "[]", "reward.clip": "null"}


def test_unknown_or_missing_tracker_is_refused_in_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"^config key 'logging.report_to': unknown tracker 'mlflow' \(known: "
                                        r"tensorboard, wandb, trackio\)$"):
        check_trackers(["tensorboard", "mlflow"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(UserError) as exc:
        check_trackers(["trackio"])
    assert str(exc.value) == ("config key 'logging.report_to' includes 'trackio' but it is not installed: "
                              "pip install 'rlhfkit[trackio]'")
    check_trackers(["tensorboard", "wandb"])  # installed (the dev extra): accepted
    assert set(TRACKERS) == {"tensorboard", "wandb", "trackio"}


# W&B ------------------------------------------------------------------------------------------------------------


def _wandb_records(path: str) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log chunks (crc32c, length, type: 1 full,
    2 first, 3 middle, 4 last) in 32 KiB blocks, each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block, pieces, records = open(path, "rb").read(), 7, 32768, b"", []
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pieces += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def test_wandb_run_has_the_project_the_run_name_the_config_metrics_and_a_samples_table(tmp_path, monkeypatch):
    from rlhfkit.trackers import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("my-project", "run-7", CONFIG, str(tmp_path))
    sink.log(1, {"loss": 1.5, "objective/kl": 0.25})
    sink.log(2, {"loss": 1.0})
    sink.log_samples(2, ROWS)
    sink.close()
    import wandb

    wandb.teardown()  # finish() can return before W&B's service has flushed the .wandb file; its shutdown waits

    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    records = _wandb_records(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("my-project", "run-7")
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == CONFIG
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h.get("loss"), h.get("objective/kl")) for h in history] == [(1, 1.5, 0.25), (2, 1.0, None)]
    assert (history[1]["samples/_type"], history[1]["samples/nrows"], history[1]["samples/ncols"]) == ("table-file", 2, 3)
    with open(os.path.join(run_dir, "files", history[1]["samples/path"])) as f:
        table = json.load(f)
    assert table == {"columns": ["prompt", "completion", "reward"], "data": [list(r.values()) for r in ROWS]}


# TensorBoard ----------------------------------------------------------------------------------------------------


def test_tensorboard_event_file_holds_scalars_samples_as_text_and_the_config_as_hparams(tmp_path):
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util.tensor_util import make_ndarray

    from rlhfkit.trackers import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path / "tb"), CONFIG)
    sink.log(1, {"loss": 1.5, "objective/kl": 0.25})
    sink.log(2, {"loss": 1.0})
    sink.log_samples(2, ROWS)
    sink.close()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.5), (2, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("objective/kl")] == [(1, 0.25)]
    (samples,) = acc.Tensors("samples/text_summary")
    assert samples.step == 2
    assert make_ndarray(samples.tensor_proto)[0].decode() == (
        "| prompt | completion | reward |\n|---|---|---|\n"
        "| Rate it: | great \\| fine<br>really | 0.5 |\n| Say hi | hi | -1.25 |")
    (config_text,) = acc.Tensors("config/text_summary")
    assert yaml.safe_load(make_ndarray(config_text.tensor_proto)[0].decode().strip("`").removeprefix("yaml\n")) == CONFIG
    start = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
    assert hparams == {"stage": "grpo", "seed": 3.0, "optim.lr": 0.1, "optim.scheduler": "linear",
                       "reward.model": "[]", "reward.clip": "null"}


# trackio --------------------------------------------------------------------------------------------------------


def test_trackio_store_holds_metrics_config_and_samples(tmp_path):
    # trackio reads TRACKIO_DIR when it is imported: a fresh interpreter points it at tmp_path.
    script = textwrap.dedent(f"""
        import json
        from rlhfkit.trackers import TrackioSink
        sink = TrackioSink("my-project", "run-7", {CONFIG!r})
        sink.log(1, {{"loss": 1.5, "objective/kl": 0.25}})
        sink.log(2, {{"loss": 1.0}})
        sink.log_samples(2, {ROWS!r})
        sink.close()

        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        (run,) = list(trackio.Api().runs("my-project"))
        print("RESULT" + json.dumps({{"name": run.name, "config": run.config,
                                      "logs": SQLiteStorage.get_logs("my-project", "run-7")}}))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    assert result["name"] == "run-7"
    assert {k: v for k, v in result["config"].items() if not k.startswith("_")} == CONFIG
    logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in result["logs"]]
    assert logs[:2] == [{"step": 1, "loss": 1.5, "objective/kl": 0.25}, {"step": 2, "loss": 1.0}]
    assert logs[2] == {"step": 2, "samples": {"_type": "trackio.table", "_value": ROWS}}
    assert os.path.isfile(tmp_path / "trackio" / "my-project.db")


def test_build_sinks_makes_each_named_sink_on_the_main_process_only(tmp_path, monkeypatch):
    from rlhfkit.trackers import TensorBoardSink, WandbSink, build_sinks, run_config
    from rlhfkit.config import SFTConfig, load_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(SFTConfig, None, ["model.name_or_path=tiny", "data.train=x.jsonl", f"output_dir={tmp_path}"])
    config = run_config(cfg, "sft")
    assert config["stage"] == "sft" and config["optim"]["lr"] == cfg.optim.lr and config["output_dir"] == str(tmp_path)
    kwargs = dict(project="p", run_name="r", output_dir=str(tmp_path))
    assert build_sinks(["tensorboard", "wandb"], config, is_main=False, **kwargs) == []
    with pytest.raises(UserError, match="unknown tracker 'mlflow'"):  # refused on every process, not only the main one
        build_sinks(["mlflow"], config, is_main=False, **kwargs)
    sinks = build_sinks(["tensorboard", "wandb"], config, is_main=True, **kwargs)
    assert [type(s) for s in sinks] == [TensorBoardSink, WandbSink]
    for s in sinks:
        s.log(1, {"loss": 2.0})
        s.close()
    assert glob.glob(str(tmp_path / "runs" / "r" / "events.out.tfevents.*"))
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))


# Through the real CLI: the run's sinks -----------------------------------------------------------------------------

GRPO = ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=4", "logging.sample_log_steps=2", "logging.logging_steps=1",
        "logging.progress_bar=false", "logging.run_name=my-run"]


def _config_yaml(out) -> dict:
    import yaml

    with open(os.path.join(out, "config.yaml")) as f:
        return yaml.safe_load(f)


def _metric_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_cli_wandb_run_is_named_in_its_project_with_the_config_and_a_completions_table(tmp_path, monkeypatch):
    from rlhfkit.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main(GRPO + [f"output_dir={out}", "logging.report_to=[wandb]", "logging.project=rlhfkit-tests"]) == 0
    import wandb

    wandb.teardown()
    (run_dir,) = glob.glob(str(out / "wandb" / "offline-run-*"))
    records = _wandb_records(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("rlhfkit-tests", "my-run")  # the project is logging.project
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == {"stage": "grpo", **_config_yaml(out)}
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = {(h["_step"], k): v for h in history for k, v in h.items() if not k.startswith(("_", "samples"))}
    for row in _metric_rows(out):  # every metrics.jsonl row, at its step
        assert all(logged[(row["step"], k)] == pytest.approx(v) for k, v in row.items() if k != "step" and v is not None)
    tables = [h for h in history if "samples/_type" in h]
    assert [h["_step"] for h in tables] == [1, 2, 4]  # step 1, every logging.sample_log_steps=2, the last
    with open(os.path.join(run_dir, "files", tables[-1]["samples/path"])) as f:
        table = json.load(f)
    with open(out / "samples.jsonl") as f:
        last = [json.loads(line) for line in f if json.loads(line)["step"] == 4]
    assert table["columns"] == ["prompt", "response", "score", "kl"]
    assert [row[:2] for row in table["data"]] == [[r["prompt"], r["response"]] for r in last]


def test_cli_tensorboard_holds_the_runs_scalars_completions_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util.tensor_util import make_ndarray

    from rlhfkit.cli import main

    out = tmp_path / "run"
    assert main(GRPO + [f"output_dir={out}", "logging.report_to=[tensorboard]"]) == 0
    acc = EventAccumulator(str(out / "runs" / "my-run"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    rows = _metric_rows(out)
    assert [(e.step, e.value) for e in acc.Scalars("objective/scores")] == [
        (r["step"], pytest.approx(r["objective/scores"])) for r in rows]
    assert [t.step for t in acc.Tensors("samples/text_summary")] == [1, 2, 4]
    first = make_ndarray(acc.Tensors("samples/text_summary")[0].tensor_proto)[0].decode()
    assert first.startswith("| prompt | response | score | kl |\n|---|---|---|---|\n")
    start = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
    assert (hparams["stage"], hparams["max_steps"], hparams["logging.sample_log_steps"]) == ("grpo", 4.0, 2.0)
    assert hparams["logging.run_name"] == "my-run"


def test_cli_trackio_store_holds_the_runs_metrics_and_config(tmp_path):
    # trackio reads TRACKIO_DIR at import: the run and the read-back each in a fresh interpreter.
    out = tmp_path / "run"
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "rlhfkit.cli", *GRPO, f"output_dir={out}", "logging.report_to=[trackio]",
           "logging.project=rlhfkit-tests"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    script = textwrap.dedent("""
        import json
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        (run,) = list(trackio.Api().runs("rlhfkit-tests"))
        print("RESULT" + json.dumps({"name": run.name, "config": run.config,
                                     "logs": SQLiteStorage.get_logs("rlhfkit-tests", "my-run")}))
    """)
    read = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr
    result = json.loads(next(line for line in read.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    assert result["name"] == "my-run"
    assert {k: v for k, v in result["config"].items() if not k.startswith("_")} == {"stage": "grpo", **_config_yaml(out)}
    scores = [(row["step"], row["objective/scores"]) for row in result["logs"] if "objective/scores" in row]
    assert scores == [(r["step"], pytest.approx(r["objective/scores"])) for r in _metric_rows(out)]
    assert [row["step"] for row in result["logs"] if "samples" in row] == [1, 2, 4]


def test_cli_refuses_an_uninstalled_tracker_and_an_offline_push_before_loading_a_model(tmp_path, capsys):
    from rlhfkit.cli import main

    out = tmp_path / "run"
    assert main(GRPO + [f"output_dir={out}", "logging.report_to=[mlflow]"]) == 2
    assert "logging.report_to" in capsys.readouterr().err
    # conftest sets HF_HUB_OFFLINE=1
    assert main(GRPO + [f"output_dir={out}", "logging.push_to_hub=true", "logging.hub_model_id=me/m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("config key 'logging.push_to_hub': the hub is offline (HF_HUB_OFFLINE is set); unset it or "
                            "pass logging.push_to_hub=false")
    assert not out.exists()  # refused before anything was written


# Held-out completions beside the training samples; a resumed run continues its tracker runs --------------------------

EVAL_ROWS = [{**row, "split": "eval"} for row in ROWS]


def _wandb_history(run_dir: str) -> list[dict]:
    records = _wandb_records(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0])
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_eval_samples_go_under_eval_samples_beside_the_training_samples_of_the_same_step(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    from rlhfkit.trackers import TensorBoardSink, WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for sink in (WandbSink("p", "r", CONFIG, str(tmp_path)), TensorBoardSink(str(tmp_path / "tb"), CONFIG)):
        sink.log_samples(2, ROWS)
        sink.log_samples(2, EVAL_ROWS)  # the held-out completions of the same step (rlhfkit.trainers.held_out)
        sink.close()
    import wandb

    wandb.teardown()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    (row,) = _wandb_history(run_dir)
    tables = {}
    for key in ("samples", "eval/samples"):
        assert (row["_step"], row.get(f"{key}/_type"), row.get(f"{key}/nrows")) == (2, "table-file", 2), key
        with open(os.path.join(run_dir, "files", row[f"{key}/path"])) as f:
            tables[key] = json.load(f)
    assert tables["samples"]["columns"] == ["prompt", "completion", "reward"]
    assert tables["eval/samples"]["columns"] == ["prompt", "completion", "reward", "split"]

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {tag: [(e.step, make_ndarray(e.tensor_proto)[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]
             for tag in ("samples", "eval/samples")}
    assert [s for s, _ in texts["samples"]] == [2] and "| split |" not in texts["samples"][0][1]
    assert [s for s, _ in texts["eval/samples"]] == [2] and "| split |" in texts["eval/samples"][0][1]


def _offline_runs(out) -> list[str]:
    """The W&B run id of each offline run directory (offline-run-<time>-<id>) under `out`/wandb, oldest first."""
    return [os.path.basename(d).rsplit("-", 1)[1] for d in sorted(glob.glob(str(out / "wandb" / "offline-run-*")))]


def _trackio_read(env: dict, project: str) -> dict:
    script = textwrap.dedent(f"""
        import json
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        runs = list(trackio.Api().runs({project!r}))
        print("RESULT" + json.dumps({{"names": [r.name for r in runs],
                                     "logs": SQLiteStorage.get_logs({project!r}, "my-run")}}))
    """)
    read = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr
    return json.loads(next(line for line in read.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def _cli(env: dict, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "rlhfkit.cli", *GRPO, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cli_eval_completions_reach_every_tracker_under_eval_samples(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.getcwd(), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    _cli(env, "max_steps=2", "data.eval=data/tiny/prompts_eval.jsonl", "logging.eval_steps=1", f"output_dir={out}",
         "logging.report_to=[wandb,tensorboard,trackio]", "logging.project=rlhfkit-tests")
    with open(out / "samples.jsonl") as f:
        logged = [json.loads(line) for line in f]
    splits = {(r["step"], r.get("split", "train")) for r in logged}
    assert splits == {(step, split) for step in (1, 2) for split in ("train", "eval")}

    (run_dir,) = glob.glob(str(out / "wandb" / "offline-run-*"))
    history = _wandb_history(run_dir)
    for key in ("samples", "eval/samples"):
        assert [h["_step"] for h in history if f"{key}/_type" in h] == [1, 2], key
    last = [h for h in history if h["_step"] == 2 and "eval/samples/path" in h][-1]
    with open(os.path.join(run_dir, "files", last["eval/samples/path"])) as f:
        table = json.load(f)
    assert table["columns"][-1] == "split" and {row[-1] for row in table["data"]} == {"eval"}
    assert len(table["data"]) == len([r for r in logged if r["step"] == 2 and r.get("split") == "eval"])

    acc = EventAccumulator(str(out / "runs" / "my-run"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [t.step for t in acc.Tensors("samples/text_summary")] == [1, 2]
    assert [t.step for t in acc.Tensors("eval/samples/text_summary")] == [1, 2]

    logs = _trackio_read(env, "rlhfkit-tests")["logs"]
    assert [row["step"] for row in logs if "samples" in row] == [1, 2]
    assert [row["step"] for row in logs if "eval/samples" in row] == [1, 2]
    assert {r["split"] for row in logs if "eval/samples" in row for r in row["eval/samples"]["_value"]} == {"eval"}


def test_cli_resumed_run_continues_its_wandb_and_trackio_runs_and_an_overwrite_starts_new_ones(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.getcwd(), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    args = [f"output_dir={out}", "logging.report_to=[wandb,trackio]", "logging.project=rlhfkit-tests",
            "logging.save_steps=2"]
    _cli(env, *args, "max_steps=3")  # checkpoint-2, then the final model at step 3
    (first,) = _offline_runs(out)
    _cli(env, *args, "max_steps=4", "resume=true")  # from checkpoint-2: steps 3 and 4
    assert _offline_runs(out) == [first, first]  # one W&B run, continued (offline-run-<time>-<id>, twice)
    trackio = _trackio_read(env, "rlhfkit-tests")
    assert trackio["names"] == ["my-run"]  # one trackio run, continued
    assert sorted({row["step"] for row in trackio["logs"] if "objective/scores" in row}) == [1, 2, 3, 4]

    _cli(env, *args, "max_steps=1", "overwrite=true")  # a new run in the same directory: a new W&B run
    (fresh,) = _offline_runs(out)
    assert fresh != first
    assert _trackio_read(env, "rlhfkit-tests")["names"] == ["my-run", "my-run"]  # trackio: a new run of the same name


def test_a_run_that_fails_closes_its_trackers_so_a_resume_in_the_same_process_is_recorded(tmp_path, monkeypatch):
    """A callback raises at step 3: the W&B run is finished with the error (not left open), and the resume in the same
    Python process (a notebook's next cell) records steps 3 and 4 in the same W&B run."""
    from transformers import TrainerCallback

    from rlhfkit.stages import run_stage

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                raise RuntimeError("boom")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = [a for a in GRPO[3:] if not a.startswith("max_steps")] + [
        f"output_dir={out}", "logging.report_to=[wandb]", "logging.project=rlhfkit-tests", "logging.save_steps=2"]
    with pytest.raises(UserError, match="callback Boom.on_step_end raised RuntimeError: boom"):
        run_stage("grpo", "configs/grpo_tiny.yaml", args + ["max_steps=4"], callbacks=[Boom()])
    run_stage("grpo", "configs/grpo_tiny.yaml", args + ["max_steps=4", "resume=true"])
    first, second = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    # offline-run-<date>_<time>-<run id>, with "-<n>" appended by W&B when a directory of that name exists already
    run_id = lambda d: re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", os.path.basename(d)).group(1)  # noqa: E731
    assert run_id(first) == run_id(second)  # one W&B run, continued
    steps = [sorted({row["_step"] for row in _wandb_history(d) if "objective/scores" in row}) for d in (first, second)]
    assert steps == [[1, 2], [3, 4]]  # step 3 raised before it was logged
