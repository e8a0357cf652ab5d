"""Incremental detokenization equals decoding the whole output, one token at a time or in batches."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from zipage_jax.engine.detokenizer import IncrementalDetokenizer
from seeds import seeded_rng

CORPUS = ["naïve café — déjà vu ✓ 東京 and plain ascii words", "multi-byte: ∑ ∫ π ≈ 3.14159, emoji 🙂 🚀",
          "hello world, the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A small byte-level BPE: single tokens can be incomplete UTF-8 sequences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class DecodeOnly:
    """The tokenizer seen through ``decode`` alone, as a slow tokenizer is: the windowed path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("path", ["decode stream", "windowed decode"])
def test_one_by_one_and_batched_equal_full_decode(byte_level_tokenizer, path):
    rng = seeded_rng()
    text = " ".join(rng.choice(" ".join(CORPUS).split(), size=40))
    prompt = byte_level_tokenizer.encode("déjà vu: ")
    output = byte_level_tokenizer.encode(text)
    want = byte_level_tokenizer.decode(output)
    assert any("\ufffd" in byte_level_tokenizer.decode([t]) for t in output)  # some tokens are partial UTF-8
    detokenizing = byte_level_tokenizer if path == "decode stream" else DecodeOnly(byte_level_tokenizer)
    single = IncrementalDetokenizer(detokenizing, prompt)
    assert (single._rust is not None) == (path == "decode stream")
    pieces = [single.add(t) for t in output]
    assert "".join(pieces) == single.text == want
    assert not any("\ufffd" in p for p in pieces)  # partial UTF-8 is held back, never emitted
    batched = IncrementalDetokenizer(detokenizing, prompt)
    cuts = sorted(rng.choice(np.arange(1, len(output)), size=4, replace=False))
    for a, b in zip([0, *cuts], [*cuts, len(output)]):
        batched.extend(output[a:b])
    assert batched.text == want
    assert batched.num_added == single.num_added == len(output)
