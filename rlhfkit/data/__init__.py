"""Datasets for every stage: reading, format detection, record-by-record validation, chat templates, tokenization
with truncation counts, and the collators that build the typed batches of `rlhfkit.types`.

    sources.py   reading a local file or a hub dataset (`open_source`)
    formats.py   the record formats of each kind, detection, validation, the canonical form of a record
    render.py    chat templates (or a plain rendering) to prompt and response token ids
    tokenize.py  `tokenize_records` (one `datasets.Dataset.map`), the typed examples, `build_datasets`, the cache
    collate.py   examples to padded or padding-free batches

Pipeline: `build_datasets` reads each split (train, and eval or a held-out fraction of train) and hands its records
to `tokenize_records`, which detects the format from the first record's keys and validates each record once, as
it tokenizes it; the trainers batch the examples with the `collate_*` functions.

Tokenization is one `datasets.Dataset.map` over the records, so it can run in worker processes (the environment
variable RLHFKIT_DATA_NUM_PROC, default 1) and, in `build_datasets`, is cached on disk: the cache file is named by a
datasets fingerprint (`datasets.fingerprint.Hasher`) of the data (a local file's content hash, a hub dataset's own
fingerprint), the tokenizer (vocabulary, special tokens, chat template), the data.* settings that shape the ids and
the source of the modules that make them, so a rerun with the same file, tokenizer and settings reads the ids back
instead of tokenizing again. The cache lives in $RLHFKIT_CACHE/data (default ~/.cache/rlhfkit/data); delete it to
reclaim the space, or turn caching off with `datasets.disable_caching()`.

Record formats per kind ("text|messages" = a string or a list of {role, content} dicts, role in system/user/assistant/
tool; an assistant turn may carry TRL's `tool_calls`, and any conversational record a `tools` column of JSON schemas
that the chat template renders: see formats.py):
    sft         prompt_completion  {prompt: text|messages, completion: text|messages}
                messages           {messages}: the loss covers every assistant turn
                text               {text}: language modelling, the loss covers every token of the raw text and EOS
    preference  pairwise           {prompt: text|messages, chosen: text|messages, rejected: text|messages, margin?: number}
                                   chosen/rejected are the assistant turn(s); a message list that repeats the prompt
                                   turns first (UltraFeedback-style full conversations) has them removed
                implicit_prompt    {chosen: messages, rejected: messages, margin?}: their shared first turns are the
                                   prompt (TRL's conversational implicit prompt), or {chosen: text, rejected: text}: full
                                   "\\n\\nHuman: ...\\n\\nAssistant: ..." HH-RLHF transcripts, the prompt their shared
                                   prefix up to and including the last "\\n\\nAssistant:"
    unpaired    unpaired           {prompt: text|messages, completion: text|messages, label: bool (true = desirable)}
    prompt      prompt             {prompt: text|messages}
                messages           {messages}: every turn is prompt; a final assistant turn is dropped

`data.columns` (field -> column) renames a dataset's columns to these fields before detection; `data.subset` is the
configuration of a hub dataset (`datasets.load_dataset(name, subset, split=...)`).

Every problem is a one-line `DataError` naming the source and where: parse errors name the 1-based line of a .jsonl
file; validation and tokenization errors name the record, its 0-based index among the loaded records. With worker
processes, the error reported is the first one a worker meets, not necessarily the earliest record's.

Tokenized examples are typed dicts of python int lists (`SFTExample`, `PreferenceExample`, `UnpairedExample`,
`PromptExample`); the collators turn lists of them into tensors. They stay plain mutable dicts because trainers
index them (`train_set[i]`) and may add fields (the preference trainer's precomputed reference log-probs). Prompts
end with the generation prompt; responses are their own tokens only and end at the EOS token. A response with tool
turns has an action mask (`chosen_action_mask`, ...): 1 on the assistant's own tokens, 0 on the tool results and
the headers between turns; the collators turn it into -100 labels (SFT's labels hold it directly).
"""

from rlhfkit.data.collate import (collate_preference, collate_preference_padding_free, collate_prompts, collate_sft,
                                  collate_sft_padding_free, collate_unpaired, pack_sft)
from rlhfkit.data.formats import KINDS
from rlhfkit.data.tokenize import (IGNORE_INDEX, Example, PreferenceExample, PromptExample, SFTExample,
                                   TruncationStats, UnpairedExample, build_datasets, tokenize_records)

__all__ = [
    "collate_preference", "collate_preference_padding_free", "collate_prompts", "collate_sft",
    "collate_sft_padding_free", "collate_unpaired", "pack_sft", "KINDS", "IGNORE_INDEX", "Example",
    "PreferenceExample", "PromptExample", "SFTExample", "TruncationStats", "UnpairedExample", "build_datasets",
    "tokenize_records",
]
