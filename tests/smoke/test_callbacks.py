"""transformers' TrainerCallbacks in real runs on the tiny configs (`run_stage(..., callbacks=[...])`): the events with
a true state, a stop honoured as a finished, resumable run, a callback that raises, EarlyStoppingCallback."""

import json
import os

import pytest
from transformers import EarlyStoppingCallback, TrainerCallback

from rlhfkit.errors import UserError
from rlhfkit.stages import run_stage

SFT = ["max_steps=6", "logging.logging_steps=1", "logging.eval_steps=2", "logging.progress_bar=false"]
GRPO = ["max_steps=5", "logging.logging_steps=1", "logging.progress_bar=false"]


def rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class Recorder(TrainerCallback):
    """Records every event with the state it saw; stops the run at step `stop_at` (None: never)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.events, self.logs, self.evals = stop_at, [], [], []

    def on_train_begin(self, args, state, control, **kw):
        self.args, self.begin_state = args, (state.global_step, state.max_steps)
        self.events.append(("begin", state.global_step))

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        self.epochs = getattr(self, "epochs", []) + [state.epoch]
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", state.global_step))
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.events.append(("evaluate", state.global_step))
        self.evals.append(dict(metrics))

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, model=None, **kw):
        self.events.append(("end", state.global_step))
        self.end_history = list(state.log_history)
        self.model_seen = model is not None


def finished_and_resumable(out, step):
    for name in ("config.json", "model.safetensors", "README.md", "report.html", "config.yaml"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert os.path.isfile(os.path.join(out, f"checkpoint-{step}", "trainer_state.pt"))


def test_sft_callback_stops_at_step_2_leaving_a_finished_resumable_run(tmp_path):
    out = str(tmp_path / "run")
    rec = Recorder(stop_at=2)
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}"], callbacks=[rec])
    assert rec.events == [("begin", 0), ("step_end", 1), ("log", 1), ("step_end", 2), ("log", 2), ("log", 2),
                          ("evaluate", 2), ("save", 2), ("end", 2)]
    assert rec.begin_state == (0, 6)  # state.max_steps: the run's total
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 2]  # nothing after the stop
    assert rec.logs == [{k: v for k, v in r.items() if k != "step"} for r in logged]  # logs = the logged metrics
    assert rec.end_history == logged and rec.model_seen
    assert rec.evals == [{"eval_" + k[len("eval/"):]: v for k, v in logged[2].items() if k != "step"}]
    a = rec.args  # TrainingArguments' names, the run's values
    assert (a.output_dir, a.learning_rate, a.per_device_train_batch_size, a.gradient_accumulation_steps) == (out, 3e-3, 16, 1)
    assert (a.max_steps, a.logging_steps, a.eval_steps, a.save_steps, a.seed, a.run_name) == (6, 1, 2, 0, 0, "run")
    assert a.config.optim.scheduler == "cosine" and a.stage == "sft" and a.metric_for_best_model == "eval_loss"
    finished_and_resumable(out, 2)
    # The stopped run resumes to its end.
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}", "resume=true"])
    assert [r["step"] for r in rows(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_grpo_callback_stops_at_step_2(tmp_path):
    out = str(tmp_path / "run")
    rec = Recorder(stop_at=2)
    run_stage("grpo", "configs/grpo_tiny.yaml", GRPO + [f"output_dir={out}"], callbacks=[rec])
    assert [e for e in rec.events if e[0] != "log"] == [("begin", 0), ("step_end", 1), ("step_end", 2), ("save", 2),
                                                         ("end", 2)]
    assert [r["step"] for r in rows(out)] == [1, 2]
    assert rec.begin_state == (0, 5) and rec.args.stage == "grpo" and rec.args.metric_for_best_model is None
    finished_and_resumable(out, 2)


class OnlyLogs(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.seen.append((state.global_step, logs["loss"]))


def test_a_callback_with_only_on_log_sees_every_logged_loss(tmp_path):
    out = str(tmp_path / "run")
    cb = OnlyLogs()
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}", "logging.eval_steps=0", "data.eval=null"],
              callbacks=[cb])
    assert cb.seen == [(r["step"], r["loss"]) for r in rows(out)]
    assert len(cb.seen) == 6


class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 3:
            raise RuntimeError("boom\nsecond line")


def test_a_raising_callback_stops_the_run_in_one_line_naming_it_with_the_checkpoint_intact(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(UserError) as exc:
        run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}", "logging.save_steps=2"], callbacks=[Boom()])
    assert str(exc.value) == "callback Boom.on_step_end raised RuntimeError: boom; the run stopped at step 3"
    assert os.path.isfile(os.path.join(out, "checkpoint-2", "trainer_state.pt"))
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}", "resume=true"])  # the checkpoint resumes
    assert rows(out)[-1]["step"] == 6


def test_transformers_early_stopping_callback_stops_on_the_eval_loss(tmp_path):
    out = str(tmp_path / "run")
    # Any change under 100 nats counts as no improvement: the second evaluation (step 4) stops the run.
    early = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=100.0)
    rec = Recorder()
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}"], callbacks=[early, rec])
    evals = [r for r in rows(out) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and rows(out)[-1]["step"] == 4
    assert early.early_stopping_patience_counter == 1
    finished_and_resumable(out, 4)


def test_early_stopping_is_refused_where_no_eval_loss_is_watched(tmp_path):
    with pytest.raises(UserError, match=r"^callback EarlyStoppingCallback.on_train_begin raised AssertionError: "
                                        r"EarlyStoppingCallback requires metric_for_best_model to be defined"):
        run_stage("grpo", "configs/grpo_tiny.yaml", GRPO + [f"output_dir={tmp_path / 'run'}"],
                  callbacks=[EarlyStoppingCallback()])


def test_a_callback_must_be_a_trainer_callback(tmp_path):
    with pytest.raises(UserError, match=r"^callbacks\[0\]: expected a transformers TrainerCallback, got int$"):
        run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={tmp_path / 'run'}"], callbacks=[3])


def test_args_map_every_training_argument_with_a_true_counterpart_and_state_epoch_follows_the_steps(tmp_path):
    out = str(tmp_path / "run")
    rec = Recorder()
    run_stage("sft", "configs/sft_tiny.yaml", SFT + [f"output_dir={out}", "optim.weight_decay=0.01", "optim.max_grad_norm=0.5",
                                                     "logging.save_total_limit=3", "model.gradient_checkpointing=true",
                                                     "optim.warmup_steps=1", "optim.adam_betas=[0.8, 0.95]"],
              callbacks=[rec])
    a = rec.args
    assert (a.warmup_steps, a.warmup_ratio, a.weight_decay, a.lr_scheduler_type, a.max_grad_norm) == (1, 0.0, 0.01, "cosine", 0.5)
    assert (a.adam_beta1, a.adam_beta2, a.adam_epsilon) == (0.8, 0.95, 1e-8)
    assert (a.bf16, a.fp16) == (False, False)  # mixed_precision auto on a CPU: none
    assert (a.save_total_limit, a.gradient_checkpointing, a.push_to_hub, a.hub_model_id) == (3, True, False, None)
    assert (a.logging_dir, a.per_device_eval_batch_size) == (out, 16)
    # 256 records in batches of 16: 16 steps per epoch, so step k ends at epoch k/16 (transformers' fractional epoch).
    assert rec.epochs == [k / 16 for k in range(1, 7)]


def test_online_dpo_is_named_online_dpo(tmp_path):
    rec = Recorder()
    run_stage("online_dpo", "configs/online_dpo_tiny.yaml", GRPO + ["max_steps=1", f"output_dir={tmp_path / 'run'}"],
              callbacks=[rec])
    assert rec.args.stage == "online_dpo"
    assert rec.epochs == [1 / 32]  # 256 prompts in rollout batches of 8


GRPO_EVAL = GRPO + ["data.eval=data/tiny/prompts_eval.jsonl", "logging.eval_steps=1"]


def test_early_stopping_on_an_online_stage_follows_the_metric_named_in_the_config(tmp_path):
    out = str(tmp_path / "run")
    early = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=100.0)
    rec = Recorder()
    run_stage("grpo", "configs/grpo_tiny.yaml", GRPO_EVAL + [f"output_dir={out}", "logging.metric_for_best_model=objective/scores"],
              callbacks=[early, rec])
    evals = [r for r in rows(out) if "eval/objective/scores" in r]
    assert [r["step"] for r in evals] == [1, 2] and rows(out)[-1]["step"] == 2  # the second evaluation stopped it
    assert rec.args.metric_for_best_model == "eval_objective/scores" and rec.args.greater_is_better is True
    assert early.early_stopping_patience_counter == 1
    finished_and_resumable(out, 2)


def test_a_metric_for_best_model_the_evaluation_does_not_give_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^config key 'logging.metric_for_best_model': 'objective/nope' is not among the "
                                        r"figures of the evaluation at step 1 \(.*objective/scores.*\)$"):
        run_stage("grpo", "configs/grpo_tiny.yaml", GRPO_EVAL + [f"output_dir={tmp_path / 'run'}",
                                                                  "logging.metric_for_best_model=objective/nope"],
                  callbacks=[EarlyStoppingCallback()])


def test_a_metric_for_best_model_without_evaluations_is_refused_at_start(tmp_path):
    with pytest.raises(UserError, match=r"^config key 'logging.metric_for_best_model' needs evaluations during training"):
        run_stage("grpo", "configs/grpo_tiny.yaml", GRPO + [f"output_dir={tmp_path / 'run'}",
                                                             "logging.metric_for_best_model=objective/scores"])
