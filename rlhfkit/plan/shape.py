"""A model's shape from its config.json and its tokenizer's vocabulary, never its weights: what the planner sizes. A
GGUF file's shape comes from its metadata (read through transformers' GGUF support without its tensors), so planning
a GGUF model takes seconds and never converts it.

The planner counts parameters, activations and cache layer by layer, so it must know the layer: the decoder families
below share one (pre-norm attention with grouped key/value heads and rotary positions, then a gated MLP), with the
differences each family's modeling file builds (`Family`: fused projections, extra norms, q/k norms) and those its
config.json states (biases, tied embeddings, sliding windows, soft-capping). A model type outside them is refused by
name, never guessed at.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

from rlhfkit.errors import UserError


@dataclass(frozen=True)
class Family:
    """How a family's decoder layer departs from Llama's (pre-norm attention with grouped key/value heads and rotary
    positions, then a gated MLP), read from its modeling file in transformers; the rest comes from its config."""

    qkv_bias: bool = False  # q, k and v always biased (qwen2), whatever attention_bias says
    qk_norm: str = ""  # RMSNorm on q and k: "head" (over head_dim: qwen3, gemma3) or "width" (over all heads: olmo2)
    norms: int = 2  # hidden-wide RMSNorms per layer (gemma2/3 normalise before and after attention and the MLP)
    fused: bool = False  # phi3: q, k, v in one qkv_proj; gate and up in one gate_up_proj
    attention: str = "sdpa"  # what transformers loads without an attn_implementation (gemma2: eager, no sdpa)


FAMILIES = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(qkv_bias=True), "qwen3": Family(qk_norm="head"),
    "gemma": Family(), "gemma2": Family(norms=4, attention="eager"), "gemma3_text": Family(norms=4, qk_norm="head"),
    "phi3": Family(fused=True), "smollm3": Family(), "olmo2": Family(qk_norm="width"), "granite": Family(),
    "olmo3": Family(qk_norm="width"), "ministral": Family(), "exaone4": Family(qk_norm="head"),
    "hunyuan_v1_dense": Family(qk_norm="head"),
}
# Model types refused with a reason of their own (beside the generic refusal of a type outside FAMILIES).
REFUSED = {"gemma3": "Gemma 3's multimodal model (a SigLIP vision tower and projector beside its text layers, which "
                     "AutoModelForCausalLM loads whole and 'all-linear' LoRA would adapt too); the planner sizes text "
                     "models only: gemma3_text (gemma-3-1b and text-only checkpoints)"}
# The linear modules of a Llama layer (peft's "all-linear" minus the head); a family's own: `linear_shapes`.
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
    qk_norm: str | bool  # "head", "width" or "" (`Family.qk_norm`; True: "head")
    dtype: str  # config.json's dtype (what `model.dtype: auto` loads)
    o_bias: bool = False  # attention_bias biases o_proj too (every family but qwen2)
    mlp_bias: bool = False  # the MLP's three linears biased (llama, smollm3, granite: mlp_bias)
    norms: int = 2  # hidden-wide norms per layer
    fused: bool = False  # qkv_proj and gate_up_proj (phi3)
    window: int | None = None  # the sliding window of the layers marked in `sliding`
    sliding: tuple[bool, ...] = ()  # per layer of the uncut model: attends within the window only
    attention: str = "sdpa"  # what transformers loads without model.attn_implementation (gemma2: eager)
    attn_softcap: bool = False  # gemma2: eager attention caps its scores with tanh (its output kept: a B·H·T² more)
    logit_softcap: bool = False  # gemma2: logits capped with tanh, whose output the backward keeps (one B·T·V more)
    logit_scaled: bool = False  # granite: logits divided by logits_scaling (a second B·T·V while it divides)
    attn_dropout: bool = False  # attention_dropout > 0 (granite's 0.1): trained forwards drop the attention weights
    classifier: bool = True  # transformers builds a sequence classifier of the family (granite: none)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        if self.fused:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """The weights of every layer's linears: what 4-bit quantization stores in 4 bits."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def _layer_extras(self) -> dict[str, int]:
        """A layer's parameters besides its linears' weights, by tensor: its norms, q/k norms and biases."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        extras = {f"norm{n}": self.hidden for n in range(self.norms)}
        if self.qk_norm:
            width = self.qk_norm == "width"
            extras.update(q_norm=q if width else self.head_dim, k_norm=kv if width else self.head_dim)
        if self.qkv_bias:
            extras.update(q_bias=q, k_bias=kv, v_bias=kv)
        if self.o_bias:
            extras["o_bias"] = self.hidden
        if self.mlp_bias:
            extras.update(gate_bias=self.intermediate, up_bias=self.intermediate, down_bias=self.hidden)
        return extras

    @property
    def other_layer_params(self) -> int:
        """Per-model parameters of the layers besides the linear weights: norms, q/k/v biases, q/k norms."""
        return self.layers * sum(self._layer_extras().values()) + self.hidden  # + the final norm

    @property
    def layer_tensors(self) -> int:
        """Parameter tensors of one layer (what the optimizer steps one by one)."""
        return len(self.linear_shapes()) + len(self._layer_extras())

    def params(self, head: str = "lm") -> int:
        """All parameters with `head`: "lm" (a causal LM), "score" (a sequence classifier: one output, no LM head),
        or "none" (the bare backbone)."""
        embed = self.vocab * self.hidden
        top = {"lm": 0 if self.tied else embed, "score": self.hidden, "none": 0}[head]
        return embed + self.linear_params + self.other_layer_params + top

    def lora_params(self, r: int, targets: str | list[str]) -> int:
        """Parameters of rank-`r` adapters on `targets` ("all-linear" or module names): r·(in + out) per linear."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else [t.rpartition(".")[2] for t in targets]
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise UserError(f"config key 'model.lora.target_modules': {unknown!r} is not a linear of a {self.family} "
                            f"layer ({', '.join(shapes)})")
        return self.layers * sum(r * sum(shapes[n]) for n in dict.fromkeys(names))

    def kv_positions(self, length: int, static: bool) -> int:
        """Cache positions over all layers for a row of `length` tokens: every layer holds all of them in the
        engine's DynamicCache (it masks the window itself); a StaticCache's sliding layers hold the window at most."""
        if not static or self.window is None:
            return self.layers * length
        windowed = sum(self.sliding[:self.layers])
        return (self.layers - windowed) * length + windowed * min(length, self.window)


def shape_of(config: dict, where: str, vocab: int | None = None, num_layers: int | None = None) -> ModelShape:
    """The shape a config.json mapping describes; `where` names it in errors; `vocab`: the tokenizer's length;
    `num_layers`: model.num_layers (the model cut to its first layers). The keys a config.json may leave out (head_dim,
    tied embeddings, layer types, soft-capping) take the defaults of the family's configuration class in
    transformers, as the loaded model does."""
    family = config.get("model_type")
    if family in REFUSED:
        raise UserError(f"{where}: model type {family!r} is {REFUSED[family]}")
    if family not in FAMILIES:
        raise UserError(f"{where}: model type {family!r} is not one the planner knows the layers of (supported: "
                        f"{', '.join(FAMILIES)})")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        vocab_size, intermediate = int(config["vocab_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}: expected a {family} config with hidden_size, num_attention_heads, "
                        f"num_hidden_layers, intermediate_size and vocab_size; {type(exc).__name__}: {exc}") from None
    c, fam = _configuration(family, config, where), FAMILIES[family]
    types = getattr(c, "layer_types", None)  # none: every layer slides where there is a window (mistral, phi3)
    window = getattr(c, "sliding_window", None)
    sliding = tuple(t == "sliding_attention" for t in types) if types else (True,) * layers
    bias = bool(getattr(c, "attention_bias", False))
    return ModelShape(
        family=family, vocab=max(vocab_size, vocab or 0), hidden=hidden, layers=min(layers, num_layers or layers),
        heads=heads,
        kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or hidden // heads), intermediate=intermediate,
        tied=bool(c.tie_word_embeddings), qkv_bias=fam.qkv_bias or bias, qk_norm=fam.qk_norm,
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"), o_bias=bias and not fam.qkv_bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)), norms=fam.norms, fused=fam.fused,
        window=int(window) if window and any(sliding) else None, sliding=sliding if window else (),
        attention=fam.attention,
        attn_softcap=bool(getattr(c, "attn_logit_softcapping", None)),
        logit_softcap=bool(getattr(c, "final_logit_softcapping", None)),
        logit_scaled=float(getattr(c, "logits_scaling", 1.0) or 1.0) != 1.0,
        attn_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0, classifier=_has_classifier(family))


def _has_classifier(family: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return family in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


def as_classifier(shape: ModelShape, where: str) -> ModelShape:
    """`shape` as a sequence classifier (the rm stage's model, a reward model, a critic), refused in one line for a
    family transformers builds none of (`AutoModelForSequenceClassification` would refuse it at load)."""
    if not shape.classifier:
        raise UserError(f"{where}: transformers has no sequence-classification model of type {shape.family!r}, which "
                        "a reward model, a critic and the rm stage load")
    return shape


def _configuration(family: str, config: dict, where: str):
    """The family's configuration object in transformers built from `config` (no model, no weights): its defaults
    and derived fields (layer_types from a window pattern) are the loaded model's."""
    from transformers import AutoConfig
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # token ids outside a tiny vocabulary and the like: not the planner's business
    try:
        return AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{where}: not a valid {family} config: {first}") from None
    finally:
        logging.set_verbosity(verbosity)


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
    """The local directory holding the config.json (and tokenizer files, chat template) of model `name`: a directory
    as is, "tiny" through `model_sources` (built once, cached), a hub name's config, tokenizer and template files
    alone from the hub cache or the hub."""
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
        for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
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


@functools.lru_cache(maxsize=8)
def shortest_prompt(name: str, revision: str | None = None, chat_template: str | None = None) -> int:
    """The fewest tokens a prompt renders to: an empty one through the data's own encoder (`data.render.Encoder`:
    the chat template's turns around it and its generation prompt, SmolLM2-135M-Instruct's default system turn
    included: 30 tokens; without a template, the tokenizer's special tokens). 0 where the tokenizer's files cannot
    be read (a name that is no directory, a hub model without tokenizer.json): the plan then counts whole rows."""
    from transformers import AutoTokenizer

    from rlhfkit.data.formats import Canonical
    from rlhfkit.data.render import Encoder
    from rlhfkit.templates import apply_setting

    try:
        tokenizer = AutoTokenizer.from_pretrained(config_dir(name, revision))
    except (UserError, OSError, ValueError):
        return 0
    apply_setting(tokenizer, chat_template)
    if tokenizer.eos_token_id is None:  # the data refuses it (`Encoder`)
        return 0
    return len(Encoder(tokenizer).prompt(Canonical(prompt="", responses=[]), "the planner's shortest prompt"))


def cut(shape: ModelShape, num_layers: int | None) -> ModelShape:
    """`shape` cut to its first `num_layers` layers (model.num_layers), as `shape_of` cuts a config's."""
    return replace(shape, layers=min(shape.layers, num_layers or shape.layers))
