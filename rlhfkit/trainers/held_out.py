"""Evaluation during the sampling stages' training (online RL and RFT), used the same way by both loops.

With held-out prompts (`data.eval`, or `data.eval_fraction` of the train prompts) and/or reference texts
(`data.capability`), the run is evaluated every `logging.eval_steps` optimizer steps and after its last step (only
then when `eval_steps` is 0): `evaluation.during_training`'s figures — `rlhfkit eval`'s own — are logged under
`eval/` at that step, the first samples go to samples.jsonl marked `"split": "eval"`, and the alignment tax
(`capability/delta_nats`) is what the `alignment_tax` alarm reads, against `alarms.alignment_tax_nats`. The eval
prompts are sampled in batches of the stage's prompts per `generate` call (online: `algo.rollout_batch_size`; rft:
`algo.sampling_batch_size`), batch i under seed `seed + i`: the figures are a function of the weights, not of the
step, the world size or the training's random state.
"""

from __future__ import annotations

from rlhfkit.config import DataConfig
from rlhfkit.errors import UserError
from rlhfkit.evaluation.agent import AgentOptions, load_format_check
from rlhfkit.evaluation.alarms import AlarmThresholds
from rlhfkit.evaluation.during_training import capability_figures, held_out_figures
from rlhfkit.objects import Objects
from rlhfkit.rollout.maker import FreshRollout
from rlhfkit.sharding import gathered_weights


def capability_set(cfg, tokenizer) -> list[dict]:
    """The tokenised SFT records of `data.capability` (none without it), read as `rlhfkit eval` reads its
    `capability_data`."""
    d = cfg.data
    if not d.capability:
        return []
    from rlhfkit.data import build_datasets

    source = DataConfig(train=d.capability, train_split=d.eval_split, subset=d.subset, columns=d.columns,
                        max_length=d.max_length, max_prompt_length=d.max_prompt_length, truncation=d.truncation)
    examples, _ = build_datasets("sft", source, tokenizer, cfg.seed)
    return examples


class HeldOutEval:
    """The evaluation of one run: `due(step)` says when, calling it evaluates, logs and returns the figures."""

    def __init__(self, run, cfg, tokenizer, prompts: list[dict] | None, capability: list[dict], batch_size: int,
                 objects: Objects | None = None):
        """`objects`: what the Python API was given. The held-out prompts are sampled by the run's own rollout
        component (`Objects.rollout` honoured), with environments of their own; with tools (`objects.toolbox`) they
        are played as episodes, and the agent figures (`cfg.agent`) logged beside the others."""
        self.run, self.cfg, self.tokenizer = run, cfg, tokenizer
        self.rollout = FreshRollout(cfg, tokenizer, objects or Objects())
        self.agent = None
        if self.rollout.toolbox is not None:
            a = cfg.agent
            self.agent = AgentOptions(load_format_check(a.format_check), a.task_judge, a.task_threshold)
        self.prompts, self.capability, self.batch_size = list(prompts or []), capability, batch_size
        self.thresholds = AlarmThresholds(alignment_tax_nats=cfg.alarms.alignment_tax_nats)

    @property
    def enabled(self) -> bool:
        return bool(self.prompts or self.capability)

    def check_reference(self, reference) -> None:
        """Refuse, before training, an evaluation that cannot run: a capability set with no reference, or a reference
        in a ZeRO-3 engine (its forwards are collective, and the processes' shares of the eval set can differ)."""
        if self.capability and reference is None:
            raise UserError("data.capability: the alignment tax compares the policy with its reference, and this "
                            "algorithm keeps none")
        plugin = getattr(self.run.accelerator.state, "deepspeed_plugin", None)
        if self.enabled and reference is not None and not reference.shared and getattr(plugin, "zero_stage", 0) == 3:
            raise UserError("data.eval: evaluation during training under DeepSpeed ZeRO-3 needs the reference to be the "
                            "policy's own base (model.lora.enabled=true); evaluate the saved model with `rlhfkit eval`")

    def due(self, done: int, last: bool) -> bool:
        """Whether to evaluate after optimizer step `done` (1-based); `last`: it is the run's last step."""
        every = self.cfg.logging.eval_steps
        return self.enabled and (last or bool(every and done % every == 0))

    def __call__(self, done: int, model, reference, rewards, total_steps: int) -> dict[str, float]:
        """Evaluate the prepared `model` (every process together), log the figures at step `done` of `total_steps`,
        return them. The reward functions get the training's `trainer_state` (global_step `done`)."""
        from rlhfkit.reward_functions import trainer_state

        run, cfg = self.run, self.cfg
        acc = run.accelerator
        state = acc if run.world > 1 else None
        figures, rows = {}, []
        with gathered_weights(acc, model, run.unwrap(model)) as policy:  # FSDP / ZeRO-3: whole while sampling
            training = policy.training
            policy.eval()
            try:
                if self.prompts:
                    figures, rows = held_out_figures(policy, reference, rewards, self.tokenizer, self.prompts,
                                                     cfg.generation, self.batch_size, cfg.seed, state,
                                                     trainer_state=trainer_state(done, total_steps),
                                                     rollout=self.rollout, agent=self.agent)
                if self.capability:
                    figures.update(capability_figures(policy, reference, self.capability, self.tokenizer.pad_token_id,
                                                      cfg.optim.per_device_batch_size, state))
            finally:
                policy.train(training)
        run.evaluated(done, figures)  # logged, then the callbacks' on_evaluate
        run.log_samples(done, [{**row, "split": "eval"} for row in rows])
        run.write(f"eval at step {done}: " + ", ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in figures.items()
                                                      if not k.startswith("eval/rewards/")))
        return figures
