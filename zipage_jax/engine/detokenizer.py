"""Incremental detokenization: decode only a short tail window per new token, not the whole output.

A fast (Rust) tokenizer decodes through ``tokenizers``' own ``DecodeStream``, about ten times cheaper per token than
two Python-level ``decode`` calls; the engine detokenizes every running request at every step of a server, so this
is host time the device would otherwise wait for. Other tokenizers keep the windowed decode.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def load_tokenizer(path):
    """The HF tokenizer at ``path`` as the engine uses it: no length limit of its own (the engine checks prompt
    lengths against ``max_model_len``, and the tokenizer would only warn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 2**62
    return tokenizer


class IncrementalDetokenizer:
    """Keeps ``text`` equal to the decoded output tokens while decoding O(window) tokens per step.

    A token can be an incomplete UTF-8 sequence or change how its predecessor renders; like vLLM we keep a
    prefix offset a few tokens back and emit text only once it no longer ends in a replacement character.
    """

    CONTEXT = 6  # prompt tokens kept as context, so the first output token renders as it would mid-text

    def __init__(self, tokenizer, prompt_token_ids=(), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens  # honoured by slow tokenizers
        self.ids: list[int] = list(prompt_token_ids[-self.CONTEXT:])
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_added = 0  # output tokens seen so far
        rust = getattr(tokenizer, "_tokenizer", None)
        self._rust = rust if isinstance(rust, Tokenizer) else None
        if self._rust is not None:
            self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly readable text (may be empty)."""
        return self.extend([token_id])

    def extend(self, token_ids) -> str:
        """Append tokens (two decodes whatever their number); return the newly readable text."""
        self.num_added += len(token_ids)
        if self._rust is not None:
            new = "".join(piece for piece in (self._stream.step(self._rust, t) for t in token_ids) if piece)
            self.text += new
            return new
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.text += new
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""
