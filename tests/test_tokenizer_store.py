"""The stored tokenizer of a warm start against transformers' tokenizer of the same files (the oracle)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import zipage_jax
from zipage_jax.engine.tokenizer_store import (ServingTokenizer, StoredTokenizer, load_engine_tokenizer,
                                              load_serving_tokenizer, start_engine_tokenizer)
from seeds import fresh_seed

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
SHIPPED = Path(zipage_jax.__file__).parent / "assets" / "tiny-reasoner"
TOKENIZERS = [*(FIXTURES / name for name in ("llama", "llama3_rope", "qwen2", "qwen3", "qwen3_untied")), SHIPPED]
PIECES = ["hi", " there", "<eos>", "<|im_end|>", "<think>", "\n\n", "  ", "ünï", "123", ",", "é", "a b", "\t"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(transformers' tokenizer, the stored one) per tokenizer: the first load stores, the second reads."""
    store = tmp_path_factory.mktemp("tokenizers")
    out = []
    for path in TOKENIZERS:
        assert not isinstance(load_engine_tokenizer(str(path), str(store)), StoredTokenizer)
        stored = load_engine_tokenizer(str(path), str(store))
        assert isinstance(stored, StoredTokenizer), path
        out.append((AutoTokenizer.from_pretrained(path), stored))
    return out


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, len(TOKENIZERS) - 1), pieces=st.lists(st.sampled_from(PIECES) | st.text(max_size=4)),
       special=st.booleans())
def test_stored_tokenizer_encodes_as_transformers(pairs, index, pieces, special):
    hf, stored = pairs[index]
    text = "".join(pieces)
    assert stored.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)


def test_stored_tokenizer_decodes_and_ends_as_transformers(pairs):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for hf, stored in pairs:
        assert stored.eos_token_id == hf.eos_token_id is not None
        for _ in range(40):
            ids = rng.integers(0, len(hf), size=int(rng.integers(1, 24))).tolist()
            for skip in (True, False):
                assert stored.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), seed


def test_a_corrupt_entry_is_rebuilt_and_other_files_are_other_entries(tmp_path):
    store = tmp_path / "store"
    load_engine_tokenizer(str(SHIPPED), str(store))
    (entry,) = (store / "tokenizers").iterdir()
    entry.write_text('{"pipeline": "not a tokenizer"')  # cut short
    assert not isinstance(load_engine_tokenizer(str(SHIPPED), str(store)), StoredTokenizer)
    assert isinstance(load_engine_tokenizer(str(SHIPPED), str(store)), StoredTokenizer)
    changed = tmp_path / "changed"
    shutil.copytree(SHIPPED, changed, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<think>"}))
    assert not isinstance(load_engine_tokenizer(str(changed), str(store)), StoredTokenizer)  # a new key
    stored = load_engine_tokenizer(str(changed), str(store))
    assert stored.eos_token_id == AutoTokenizer.from_pretrained(changed).eos_token_id != \
        load_engine_tokenizer(str(SHIPPED), str(store)).eos_token_id


def test_a_tokenizer_whose_decode_transformers_cleans_up_is_never_stored(tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(SHIPPED, changed, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    for _ in range(2):
        assert not isinstance(load_engine_tokenizer(str(changed), str(tmp_path / "store")), StoredTokenizer)


def test_a_warm_engine_starts_without_importing_transformers(tmp_path):
    """No start imports transformers (which imports torch where installed: seconds): the first builds the
    tokenizer's pipeline in a child process, the second reads it from the store; the user still gets transformers'
    tokenizer from ``get_tokenizer``."""
    code = f"""
import sys
from zipage_jax import LLM
llm = LLM(compilation_cache_dir={str(tmp_path)!r})
engine = llm.engine
print(type(engine.tokenizer).__name__, "transformers" in sys.modules)
print(engine.tokenizer.encode("The sum of 3 and 4 is", add_special_tokens=False), engine.eos_token_ids)
print(type(llm.get_tokenizer()).__name__, llm.get_tokenizer().encode("The sum of 3 and 4 is", add_special_tokens=False))
"""
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).parent.parent).stdout.splitlines() for _ in range(2)]
    (cold_type, cold_ids, cold_hf), (warm_type, warm_ids, warm_hf) = runs
    assert cold_type == warm_type == "StoredTokenizer False"  # cold, a child process built and stored it
    assert warm_ids == cold_ids and cold_hf == warm_hf and warm_hf.endswith(cold_ids.split("] ")[0] + "]")


def test_a_truncation_in_the_tokenizer_file_truncates_neither(tmp_path):
    """transformers' encode sets the pipeline's truncation and padding per call (none unless asked), whatever the
    file says; the stored pipeline must not keep the file's."""
    shutil.copytree(SHIPPED, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    file = tmp_path / "model" / "tokenizer.json"
    content = json.loads(file.read_text())
    content["truncation"] = dict(direction="Right", max_length=4, strategy="LongestFirst", stride=0)
    file.write_text(json.dumps(content))
    load_engine_tokenizer(str(tmp_path / "model"), str(tmp_path / "store"))
    stored = load_engine_tokenizer(str(tmp_path / "model"), str(tmp_path / "store"))
    text = "the sum of three and four is seven"
    expected = AutoTokenizer.from_pretrained(tmp_path / "model").encode(text)
    assert isinstance(stored, StoredTokenizer) and stored.encode(text) == expected and len(expected) > 4


def test_the_server_encodes_through_the_store_and_templates_through_transformers(tmp_path):
    """``serve``'s process: the stored pipeline encodes and decodes at once; chat templates come from
    transformers' tokenizer, loaded on a thread."""
    assert not isinstance(load_serving_tokenizer(str(SHIPPED), str(tmp_path)), ServingTokenizer)  # cold: stores
    serving = load_serving_tokenizer(str(SHIPPED), str(tmp_path))
    hf = AutoTokenizer.from_pretrained(SHIPPED)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    for kwargs in (dict(add_generation_prompt=True), dict(add_generation_prompt=False)):
        assert serving.apply_chat_template(messages, tokenize=False, **kwargs) == \
            hf.apply_chat_template(messages, tokenize=False, **kwargs)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for special in (True, False):
        assert serving.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    ids = hf.encode(text)
    assert serving.decode(ids) == hf.decode(ids) and serving.eos_token_id == hf.eos_token_id


def test_a_cold_start_builds_the_pipeline_in_a_child_process(tmp_path):
    """Without a stored pipeline a child process stores one and this process reads it without importing
    transformers; a tokenizer that cannot be stored, or one that fails to load, comes from transformers here, with
    its error; without a cache nothing is stored."""
    tokenizer = start_engine_tokenizer(str(SHIPPED), str(tmp_path / "cache"))()
    assert isinstance(tokenizer, StoredTokenizer) and list((tmp_path / "cache" / "tokenizers").iterdir())
    assert not isinstance(start_engine_tokenizer(str(SHIPPED), None)(), StoredTokenizer)
    hf = AutoTokenizer.from_pretrained(SHIPPED)
    assert tokenizer.encode("What is 3 + 4?") == hf.encode("What is 3 + 4?")
    changed = tmp_path / "changed"
    shutil.copytree(SHIPPED, changed, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert not isinstance(start_engine_tokenizer(str(changed), str(tmp_path / "cache"))(), StoredTokenizer)
    (changed / "tokenizer.json").write_text("{ not json")
    with pytest.raises(Exception) as child_and_here:
        start_engine_tokenizer(str(changed), str(tmp_path / "cache"))()
    with pytest.raises(type(child_and_here.value)):
        AutoTokenizer.from_pretrained(changed)
