"""Hugging Face Hub ids as models (vLLM's `LLM("Qwen/Qwen3-0.6B")`), with no real network: the Hub is a closed
local port, its cache a temporary directory, and a download is a copy of a fixture checkpoint."""

import fnmatch
import shutil
import socket
import time
import types
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub import constants

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import hub

FIXTURE = Path("tests/fixtures/hf/qwen3_untied")
HUB_ID = "Qwen/Qwen3-0.6B"
SMALL = dict(page_size=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, compilation_cache_dir=None)


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path) -> Path:
    """The Hub endpoint a closed local port and an empty Hub cache; returns the cache."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def cache_snapshot(cache: Path, repo_id: str, revision: str) -> Path:
    """The fixture checkpoint laid out as huggingface_hub caches a snapshot of ``repo_id``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(FIXTURE, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_an_uncached_hub_id_without_a_network_fails_at_once_and_says_why(unreachable_hub):
    start = time.perf_counter()
    with pytest.raises(ValueError) as error:
        LLMEngine.from_kwargs(HUB_ID, **SMALL)
    assert time.perf_counter() - start < 10  # transformers' own retries took 30 s
    message = str(error.value)
    assert message.startswith(f"model: '{HUB_ID}' is no local directory and not in the Hugging Face Hub cache")
    assert str(unreachable_hub) in message and f"hf download {HUB_ID}" in message


def test_a_cached_hub_snapshot_serves_offline_under_its_hub_id(unreachable_hub):
    snapshot = cache_snapshot(unreachable_hub, HUB_ID, "a" * 40)
    engine = LLMEngine.from_kwargs(HUB_ID, **SMALL)
    assert Path(engine.model_path) == snapshot and engine.model_name == HUB_ID  # the id clients send, as vLLM
    local = LLMEngine.from_kwargs(str(FIXTURE), **SMALL)
    assert local.model_name == FIXTURE.name
    assert np.array_equal(np.asarray(engine.worker.params.embed), np.asarray(local.worker.params.embed))


def test_an_online_hub_id_downloads_what_the_engine_reads(unreachable_hub, monkeypatch):
    calls = []

    def model_info(self, repo_id, timeout=None, **kwargs):
        assert timeout is not None  # an unanswered connection cannot hang the start
        return types.SimpleNamespace(sha="b" * 40)

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append(dict(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns, **kwargs))
        return str(cache_snapshot(unreachable_hub, repo_id, revision))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    engine = LLMEngine.from_kwargs(HUB_ID, **SMALL)
    [call] = calls
    assert call["repo_id"] == HUB_ID and call["revision"] == "b" * 40 and engine.model_name == HUB_ID
    wanted = ["config.json", "model-00001-of-00004.safetensors", "tokenizer.json", "merges.txt", "vocab.json",
              "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json"]
    skipped = ["pytorch_model.bin", "original/consolidated.00.pth", "model.gguf", "README.md"]
    fetched = lambda name: any(fnmatch.fnmatch(name, pattern) for pattern in call["allow_patterns"])  # noqa: E731
    assert all(fetched(name) for name in wanted) and not any(fetched(name) for name in skipped)


def test_a_name_that_is_neither_a_directory_nor_a_hub_id_is_a_value_error(unreachable_hub):
    with pytest.raises(ValueError, match="model: no directory at 'tests/fixtures/hf/nothing', and it is no Hug"):
        hub.local_dir("tests/fixtures/hf/nothing")
    with pytest.raises(ValueError, match="tokenizer: no directory at"):
        LLMEngine.from_kwargs(str(FIXTURE), tokenizer="/no/such/tokenizer", **SMALL)
