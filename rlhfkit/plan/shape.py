"""A model's shape from its config.json and its tokenizer's vocabulary, never its weights: what the planner sizes. A
GGUF file's shape comes from its metadata (read through transformers' GGUF support without its tensors), so planning
a GGUF model takes seconds and never converts it.

The planner counts parameters, activations and cache layer by layer, so it must know the layer: the decoder families
below share one (pre-norm attention with grouped key/value heads and rotary positions, then a gated MLP), with the
differences each family's config.json states (biases on q/k/v, norms on q/k, tied embeddings). A model type outside
them is refused by name, never guessed at.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

from rlhfkit.errors import UserError

# model_type -> (bias on q/k/v projections, RMSNorm on q and k per head)
FAMILIES = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True)}
# The linear modules of one decoder layer (peft's "all-linear" minus the head).
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one decoder-only model (counts, not bytes)."""

    family: str
    vocab: int  # embedding rows: config.json's vocab_size, or the tokenizer's length where larger
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool  # the LM head shares the embedding matrix
    qkv_bias: bool
    qk_norm: bool
    dtype: str  # config.json's dtype (what `model.dtype: auto` loads)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """The weights of every layer's linears: what 4-bit quantization stores in 4 bits."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def other_layer_params(self) -> int:
        """Per-model parameters of the layers besides the linear weights: norms, q/k/v biases, q/k norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per = 2 * self.hidden + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * per + self.hidden  # + the final norm

    def params(self, head: str = "lm") -> int:
        """All parameters with `head`: "lm" (a causal LM), "score" (a sequence classifier: one output, no LM head),
        or "none" (the bare backbone)."""
        embed = self.vocab * self.hidden
        top = {"lm": 0 if self.tied else embed, "score": self.hidden, "none": 0}[head]
        return embed + self.linear_params + self.other_layer_params + top

    def lora_params(self, r: int, targets: str | list[str]) -> int:
        """Parameters of rank-`r` adapters on `targets` ("all-linear" or module names): r·(in + out) per linear."""
        shapes = self.linear_shapes()
        names = LAYER_LINEARS if targets == "all-linear" else [t.rpartition(".")[2] for t in targets]
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise UserError(f"config key 'model.lora.target_modules': {unknown!r} is not a linear of a {self.family} "
                            f"layer ({', '.join(LAYER_LINEARS)})")
        return self.layers * sum(r * sum(shapes[n]) for n in dict.fromkeys(names))


def shape_of(config: dict, where: str, vocab: int | None = None, num_layers: int | None = None) -> ModelShape:
    """The shape a config.json mapping describes; `where` names it in errors; `vocab`: the tokenizer's length;
    `num_layers`: model.num_layers (the model cut to its first layers)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{where}: model type {family!r} is not one the planner knows the layers of (supported: "
                        f"{', '.join(FAMILIES)})")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        shape = ModelShape(
            family=family, vocab=max(int(config["vocab_size"]), vocab or 0), hidden=hidden,
            layers=min(layers, num_layers or layers), heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), intermediate=int(config["intermediate_size"]),
            tied=bool(config.get("tie_word_embeddings", False)), qkv_bias=FAMILIES[family][0] or bool(
                config.get("attention_bias", False)), qk_norm=FAMILIES[family][1],
            dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}: expected a {family} config with hidden_size, num_attention_heads, "
                        f"num_hidden_layers, intermediate_size and vocab_size; {type(exc).__name__}: {exc}") from None
    return shape


def read_json(path: str, what: str) -> dict:
    """A JSON object from `path`, or one line saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{what} '{path}' cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} '{path}': expected a JSON object, got {type(data).__name__}")
    return data


def tokenizer_length(directory: str) -> int | None:
    """`len(tokenizer)` from tokenizer.json alone (the largest id of its vocabulary and added tokens, plus one), one
    more when the tokenizer has neither a pad nor an eos token (`models.load_tokenizer` adds one); None without it."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    data = read_json(path, "tokenizer file")
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # unigram: a list of pairs
    ids += [t.get("id", 0) for t in data.get("added_tokens") or []]
    size = max(ids) + 1 if ids else 0
    config_path = os.path.join(directory, "tokenizer_config.json")
    special = read_json(config_path, "tokenizer config") if os.path.isfile(config_path) else {}
    return size + (0 if special.get("pad_token") or special.get("eos_token") else 1)


def config_dir(name: str, revision: str | None = None) -> str:
    """The local directory holding the config.json (and tokenizer files) of model `name`: a directory as is, "tiny"
    through `model_sources` (built once, cached), a hub name's config and tokenizer files alone from the hub cache or
    the hub."""
    if name == "tiny":
        from rlhfkit.config import ModelConfig
        from rlhfkit.model_sources import resolve_model_path

        return resolve_model_path(ModelConfig(name_or_path=name, revision=revision))
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model '{name}': no such directory (expected a directory with config.json, a hub name, or "
                        "'tiny')")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json", revision=revision)
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            try:
                hf_hub_download(name, extra, revision=revision)
            except Exception:  # noqa: BLE001 - a model without them is planned from config.json's vocab_size
                pass
    except Exception as exc:  # noqa: BLE001 - offline, missing repo, gated: all one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"model '{name}': config.json cannot be read from the hub: {first}") from None
    return os.path.dirname(path)


def gguf_path(name: str, gguf_file: str, revision: str | None = None) -> str:
    """The local path of GGUF file `gguf_file` of model `name` (a directory or a hub name), found as
    `model_sources` finds it; a file inside a hub repository comes from the hub cache or the hub."""
    folder, gguf = os.path.expanduser(name), os.path.expanduser(gguf_file)
    local = gguf if os.path.isabs(gguf) else os.path.join(folder, gguf)
    if os.path.isfile(local):
        return local
    if os.path.isabs(gguf) or name.startswith((".", "/", "~")) or os.path.isdir(folder) or name.count("/") != 1:
        raise UserError(f"gguf file '{local}' not found")
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(name, gguf_file, revision=revision)
    except Exception as exc:  # noqa: BLE001 - offline, missing repo, gated: all one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"model '{name}': gguf file '{gguf_file}' cannot be read from the hub: {first}") from None


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, size: int, mtime: float) -> tuple[dict, int | None]:
    """(config mapping, tokenizer length) from a GGUF file's metadata, its tensors left unread; `size` and `mtime`
    key the cache, so a pipeline planning several stages of one GGUF base reads it once."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(path, return_tensors=False)
    except Exception as exc:  # noqa: BLE001 - not a GGUF file, an unsupported architecture: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"gguf file '{path}' cannot be read: {first}") from None
    tokenizer = parsed.get("tokenizer") or {}
    tokens = len(tokenizer.get("tokens") or ())
    # as tokenizer_length: load_tokenizer adds a pad token to a tokenizer that has neither pad nor eos
    special = tokenizer.get("pad_token_id") is not None or tokenizer.get("eos_token_id") is not None
    return dict(parsed.get("config") or {}), (tokens + (0 if special else 1)) if tokens else None


def load_shape(name: str, where: str, gguf_file: str | None = None, revision: str | None = None,
               num_layers: int | None = None) -> ModelShape:
    """The shape of model `name` (config key `where`) from its config.json and tokenizer files, or from the metadata
    of its GGUF file `gguf_file`."""
    if gguf_file:
        path = gguf_path(name, gguf_file, revision)
        config, vocab = _gguf_metadata(os.path.abspath(path), os.path.getsize(path), os.path.getmtime(path))
        return shape_of(config, f"{where} ({path})", vocab, num_layers)
    directory = config_dir(name, revision)
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{where}: '{directory}' holds no config.json")
    return shape_of(read_json(path, "config.json"), f"{where} ({path})", tokenizer_length(directory), num_layers)


def cut(shape: ModelShape, num_layers: int | None) -> ModelShape:
    """`shape` cut to its first `num_layers` layers (model.num_layers), as `shape_of` cuts a config's."""
    return replace(shape, layers=min(shape.layers, num_layers or shape.layers))
