"""Loading and saving models: policy, reference, reward and value models (transformers + peft).

Also builds the tiny random model and tokenizer that tests and the `*_tiny.yaml` configs use offline.
"""

from __future__ import annotations

import os
import string

TINY_NAME = "tiny"

# A ChatML template like SmolLM2's, so the tiny tokenizer exercises the same chat-template code paths.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> str:
    """Where converted and built models are cached: $RLHFKIT_CACHE, else ~/.cache/rlhfkit."""
    return os.environ.get("RLHFKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlhfkit")


def build_tiny_tokenizer():
    """A character-level tokenizer over printable ASCII with ChatML special tokens; pad == eos (like SmolLM2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
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
