"""Character-level tokenizer of the shipped tiny model, built with the `tokenizers` library.

One token per character keeps long arithmetic scratchpads cheap to express and makes every digit a token
of its own, which is what the task's look-backs (and KV eviction) operate on. Printable ASCII and newline
are covered, so any English prompt tokenizes; anything else maps to `<unk>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
CHARS = ("\n",) + tuple(chr(c) for c in range(32, 127))

VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
PAD_ID, IM_START_ID, IM_END_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> Tokenizer:
    """The tokenizer: every character is one piece, looked up in VOCAB; decoding concatenates."""
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(directory) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) for transformers.AutoTokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(VOCAB[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def chat_prompt(question: str) -> str:
    """The chat-templated text of a single user turn followed by the assistant header."""
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"


def encode_chars(text: str) -> list[int]:
    """Ids of plain text (no special tokens), identical to the tokenizer's encoding of it."""
    return [VOCAB.get(c, UNK_ID) for c in text]


def encode_chat(question: str, completion: str | None = None) -> list[int]:
    """Ids of the templated prompt, plus `completion` and the closing <|im_end|> when given."""
    ids = [IM_START_ID, *encode_chars("user\n" + question), IM_END_ID, *encode_chars("\n"),
           IM_START_ID, *encode_chars("assistant\n")]
    if completion is not None:
        ids += [*encode_chars(completion), IM_END_ID]
    return ids
