"""Which rollout component a run uses, for training and for evaluation: chosen from its config and what the Python
API was given (`Objects.rollout` wraps or replaces it in both)."""

from __future__ import annotations

import dataclasses

from rlhfkit.errors import DataError
from rlhfkit.rollout import RolloutMaker
from rlhfkit.rollout.single_turn import SingleTurn
from rlhfkit.tools import Toolbox, import_ref


def rollout_maker(cfg, tokenizer, objects) -> RolloutMaker:
    """The rollout component of an online run (`cfg`: its config; `objects`: what the Python API was given): one
    assistant turn per sample, or with tools (`objects.toolbox`) multi-turn episodes (`tool_loop.ToolLoop`);
    `objects.rollout`, when given, is called with it and returns the component to use."""
    if objects.toolbox is not None:
        made = tool_loop(tokenizer, cfg.generation, cfg.seed, objects.toolbox, cfg.tools)
    else:
        made = SingleTurn(tokenizer, cfg.generation, cfg.seed)
    return objects.rollout(made) if objects.rollout is not None else made


def tool_loop(tokenizer, params, seed: int, toolbox: Toolbox, tools) -> RolloutMaker:
    """The tool loop (`tool_loop.ToolLoop`) of `toolbox` under a `ToolsConfig`'s limits (`tools`: max_calls,
    timeout_s, max_result_tokens) and the generation settings `params`: the one place it is made."""
    from rlhfkit.rollout.tool_loop import ToolLoop

    return ToolLoop(tokenizer, params, seed, toolbox, tools.max_calls, tools.timeout_s, tools.max_result_tokens)


class FreshRollout:
    """The rollout component an evaluation samples with: `rollout_maker`'s (so `Objects.rollout` is honoured, as in
    training), each call's episodes with environments of their own.

    A training run's environments are pooled (made once, reset before each episode), which is right when each
    rollout is scored before the next; an evaluation samples every batch, and the reference after the policy, before
    judging any of them, so a pooled instance would hold another episode's state by then. With environments, each call
    makes the component anew from a `Toolbox` of the same functions and factories."""

    def __init__(self, cfg, tokenizer, objects):
        self.cfg, self.tokenizer, self.objects = cfg, tokenizer, objects
        self.toolbox: Toolbox | None = objects.toolbox
        self.made = rollout_maker(cfg, tokenizer, objects)

    def __call__(self, policy, prompts, examples, step):
        box = self.toolbox
        if box is None or box.environments is None:
            return self.made(policy, prompts, examples, step)
        envs = box.environments
        fresh = Toolbox([t.fn for t in box.functions.values()], envs.factories if envs.routed else envs.factories[None])
        made = rollout_maker(self.cfg, self.tokenizer, dataclasses.replace(self.objects, toolbox=fresh))
        return made(policy, prompts, examples, step)


def toolbox_of(cfg, objects) -> Toolbox | None:
    """The run's tools (`tools.Toolbox`): the Python API's `tools` / `environment_factory` objects, else the config's
    tools.functions / tools.environment imported; None when the stage has no tools section or none are given. Made
    once, at start: a function get_json_schema cannot describe, or an environment without reset(), stops the run
    before any model loads."""
    tools = getattr(cfg, "tools", None)
    if tools is None or not (tools.enabled or objects.tools or objects.environment_factory is not None):
        return None
    functions = objects.tools or [import_ref(ref, f"config key 'tools.functions[{i}]' '{ref}'", "function")
                                  for i, ref in enumerate(tools.functions)]
    factory = objects.environment_factory
    if factory is None and isinstance(tools.environment, dict):
        factory = {name: import_ref(ref, f"config key 'tools.environment.{name}' '{ref}'", "class")
                   for name, ref in tools.environment.items()}
    elif factory is None and tools.environment:
        factory = import_ref(tools.environment, f"config key 'tools.environment' '{tools.environment}'", "class")
    return Toolbox(functions, factory)


def environment_rewards(objects) -> list:
    """The reward functions of the run's environments that define `get_reward()` (TRL: one source per class, weight
    1), for `rewards.Rewards(environment_rewards=...)`; empty without environments."""
    box = objects.toolbox if objects is not None else None
    return box.environments.reward_functions() if box is not None and box.environments is not None else []


def check_row_tools(toolbox: Toolbox | None, examples: list[dict], source: str) -> None:
    """Refuses at start, in one line naming `source` and the record, a prompt record whose own `tools` column its
    episode could not play (`Toolbox.row_problem`: a function that is not registered, or is described with other
    parameters); and, in a run without tools, any record with the column: its prompt would show the model tools that
    nothing runs (the run does not guess functions from schemas). `examples`: the prompt examples read from `source`
    (`data.build_datasets("prompt", ...)`)."""
    for example in examples:
        if example.get("tools") is None:
            continue
        if toolbox is None:
            raise DataError(f"{source} record {example['record']}: a `tools` column, but the run has no tools, so no "
                            "call could run: register them (tools.functions / tools.environment, or tools= / "
                            "environment_factory= in Python), or remove the column")
        why = toolbox.row_problem(example["tools"], example["columns"].get("environment"))
        if why is not None:
            raise DataError(f"{source} record {example['record']}: {why}")


def check_prompt_room(toolbox: Toolbox | None, tokenizer, examples: list[dict], max_prompt_length: int,
                      source: str) -> None:
    """Refuses at start, in one line naming `source`, the record and the lengths, a prompt that does not fit
    data.max_prompt_length once rendered with the tools its episode shows: the run's (the data layer, which cuts or
    refuses over-long prompts, never sees them), or those its own `tools` column lists. The tool loop renders its
    prompts whole (`tool_loop.ToolLoop.start`), so an over-long one would exceed the setting; cutting it would cut the
    tool definitions, which come first. An environment's reset() text, known only when an episode starts, is not
    counted. Without tools, or without a chat template (the tool loop refuses that itself), there is nothing to do."""
    if toolbox is None or not getattr(tokenizer, "chat_template", None):
        return
    envs = toolbox.environments
    for example in examples:
        schemas = example.get("tools")
        if schemas is None:
            key = example["columns"].get("environment") if envs is not None and envs.routed else None
            methods = envs.methods.get(key, {}) if envs is not None else {}
            schemas = [tool.schema for tool in {**toolbox.functions, **methods}.values()]
        prompt = example["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        length = len(tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False))
        if length > max_prompt_length:
            raise DataError(f"{source} record {example['record']}: the prompt with its tools' definitions is {length} "
                            f"tokens, longer than data.max_prompt_length={max_prompt_length}; the tool loop never cuts "
                            "a prompt (that would cut the definitions, which come first): raise data.max_prompt_length "
                            "or shorten the prompt")
