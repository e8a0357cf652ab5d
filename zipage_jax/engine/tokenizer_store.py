"""The tokenizer of a warm start without importing transformers.

transformers imports torch wherever torch is installed: 8.8 s of a 14 s warm start on an H100 host, for a tokenizer
the engine only encodes prompts and decodes tokens with. What transformers builds from a checkpoint's files is a
Rust ``tokenizers`` pipeline (transformers 5 may rebuild it from the model's tokenizer class, so the
``tokenizer.json`` alone is not it); a first start stores that pipeline, serialized, with the end-of-sequence id,
and later starts load it straight from the Rust library. Keyed by the tokenizer files' bytes and the transformers
and tokenizers versions; an entry that fails to load is rebuilt. Tokenizers whose decode transformers post-processes
in Python (``clean_up_tokenization_spaces``) or without a Rust pipeline are not stored: they load through
transformers every time.
"""

import concurrent.futures
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import tempfile

from tokenizers import Tokenizer

from zipage_jax.engine.detokenizer import load_tokenizer

log = logging.getLogger(__name__)

FORMAT = 1
KEYED_FILES = ("config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


class StoredTokenizer:
    """``encode``, ``decode`` and ``eos_token_id`` as the transformers tokenizer it was stored from gives them;
    ``_tokenizer`` is the Rust pipeline, which the incremental detokenizer streams through."""

    def __init__(self, pipeline: str, eos_token_id: int | None, name_or_path: str):
        self._tokenizer = Tokenizer.from_str(pipeline)
        self._tokenizer.no_truncation()  # as transformers' encode without truncation or padding sets them
        self._tokenizer.no_padding()
        self.eos_token_id = eos_token_id
        self.name_or_path = name_or_path

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **_) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class ServingTokenizer:
    """The server's tokenizer when the engine's is stored: encode and decode through the stored pipeline, chat
    templates through transformers' tokenizer, which loads on a thread from the start (the server's process is idle
    while its engine process starts; the first chat request waits for what is left of the load)."""

    def __init__(self, stored: StoredTokenizer, path: str):
        self._stored = stored
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._transformers = loader.submit(load_tokenizer, path)
        loader.shutdown(wait=False)
        self.encode, self.decode, self.eos_token_id = stored.encode, stored.decode, stored.eos_token_id

    def apply_chat_template(self, *args, **kwargs):
        return self._transformers.result().apply_chat_template(*args, **kwargs)


def load_serving_tokenizer(path: str, cache_dir: str | None):
    """A ``ServingTokenizer`` over the stored pipeline of ``path``'s tokenizer, else transformers' tokenizer."""
    tokenizer = load_engine_tokenizer(path, cache_dir)
    return ServingTokenizer(tokenizer, path) if isinstance(tokenizer, StoredTokenizer) else tokenizer


def load_engine_tokenizer(path: str, cache_dir: str | None):
    """The tokenizer the engine encodes and decodes with: the stored pipeline of ``path``'s tokenizer under
    ``cache_dir`` (the engine's ``compilation_cache_dir``; None: no store) if there is one, else transformers'
    tokenizer (stored there for the next start)."""
    if cache_dir is None:
        return load_tokenizer(path)
    entry = pathlib.Path(cache_dir).expanduser() / "tokenizers" / f"{_key(path)}.json"
    if entry.is_file():
        try:
            stored = json.loads(entry.read_text())
            return StoredTokenizer(stored["pipeline"], stored["eos_token_id"], str(path))
        except Exception as error:  # noqa: BLE001 (a corrupt entry of any kind is rebuilt, never used)
            log.warning("tokenizer store: %s does not load (%s); rebuilding it", entry, error)
            entry.unlink(missing_ok=True)
    tokenizer = load_tokenizer(path)
    pipeline = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(pipeline, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        _write(entry, dict(format=FORMAT, pipeline=pipeline.to_str(), eos_token_id=tokenizer.eos_token_id))
    return tokenizer


def _key(path) -> str:
    """SHA-256 of the files transformers builds the tokenizer from (the config names its class) and the libraries'
    versions."""
    digest = hashlib.sha256(f"{FORMAT} {_version('transformers')} {_version('tokenizers')}".encode())
    for file in sorted(pathlib.Path(path).iterdir()):
        if file.is_file() and (file.name in KEYED_FILES or "tokeniz" in file.name or "chat_template" in file.name):
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _write(entry: pathlib.Path, content: dict):
    """Atomically (a temporary file renamed into place): a reader never sees half an entry."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, suffix=".tmp", delete=False) as f:
            json.dump(content, f)
        os.replace(f.name, entry)
    except OSError as error:
        log.warning("tokenizer store: cannot write %s (%s)", entry, error)
