"""The engine's tokenizer without importing transformers in the engine's process.

transformers imports torch wherever torch is installed, most of a warm start's seconds (BENCHMARKS.md, start-up),
for a tokenizer the engine only encodes prompts and decodes tokens with. What transformers builds from a checkpoint's files is a
Rust ``tokenizers`` pipeline (transformers 5 may rebuild it from the model's tokenizer class, so the
``tokenizer.json`` alone is not it). That pipeline is stored, serialized, with the end-of-sequence id, keyed by the
tokenizer's files and the transformers and tokenizers versions, and later starts load it straight from the Rust
library; where none is stored yet a child process builds it while the engine starts (a thread would share the
GIL with the start, and slow it). An entry that fails to load is rebuilt. Tokenizers whose
decode transformers post-processes in Python (``clean_up_tokenization_spaces``) or without a Rust pipeline are not
stored: they load through transformers every time.
"""

import concurrent.futures
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

from zipage_jax.engine.detokenizer import load_tokenizer

log = logging.getLogger(__name__)

FORMAT = 1
KEYED_FILES = ("config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


class StoredTokenizer:
    """``encode``, ``decode`` and ``eos_token_id`` as the transformers tokenizer it was stored from gives them;
    ``_tokenizer`` is the Rust pipeline, which the incremental detokenizer streams through."""

    def __init__(self, pipeline: str, eos_token_id: int | None):
        self._tokenizer = Tokenizer.from_str(pipeline)
        self._tokenizer.no_truncation()  # as transformers' encode without truncation or padding sets them
        self._tokenizer.no_padding()
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while it tokenizes (``encode`` holds it): a server thread encoding a long
        # prompt leaves its event loop running; ``_fast`` skips the offsets nobody reads
        encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **_) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class ServingTokenizer:
    """The server's tokenizer when the engine's is stored: encode and decode through the stored pipeline, chat
    templates through transformers' tokenizer, which loads on a thread from the start (the server's process is idle
    while its engine process starts; the first chat request waits for what is left of the load)."""

    def __init__(self, stored: StoredTokenizer, path: str):
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._transformers = loader.submit(load_tokenizer, path)
        loader.shutdown(wait=False)
        self.encode, self.decode, self.eos_token_id = stored.encode, stored.decode, stored.eos_token_id
        self._tokenizer = stored._tokenizer

    def apply_chat_template(self, *args, **kwargs):
        return self.transformers().apply_chat_template(*args, **kwargs)

    def transformers(self):
        """transformers' tokenizer, once loaded."""
        return self._transformers.result()


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
    entry = _entry(path, cache_dir)
    return _read_entry(entry) or _load_and_store(path, entry)


def start_engine_tokenizer(path: str, cache_dir: str | None):
    """Start loading the engine's tokenizer; returns a function that gives it, waiting for what is left.

    A stored pipeline loads at once. Otherwise transformers builds and stores it in a child process: its import is
    seconds of Python, torch's too where installed, that would hold this process's GIL while the engine starts. The
    function then waits for the child and reads the stored pipeline,
    or, for a tokenizer that cannot be stored (or a child that failed), loads transformers' tokenizer here, raising
    what it raises. Without ``cache_dir`` nothing is kept: transformers' tokenizer loads here at the first call."""
    if cache_dir is None:
        return functools.cache(lambda: load_tokenizer(path))
    entry = _entry(path, cache_dir)  # hashes the tokenizer's files: once
    stored = _read_entry(entry)
    if stored is not None:
        return lambda: stored
    package_root = str(pathlib.Path(__file__).resolve().parents[2])  # the child imports this module as we did
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-m", __name__, str(path), str(entry)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @functools.cache
    def result():
        child.wait()
        return _read_entry(entry) or load_tokenizer(path)
    return result


def _read_entry(entry: pathlib.Path) -> StoredTokenizer | None:
    """The pipeline stored in ``entry``, or None (a corrupt entry is deleted: rebuilt, never used)."""
    if not entry.is_file():
        return None
    try:
        stored = json.loads(entry.read_text())
        return StoredTokenizer(stored["pipeline"], stored["eos_token_id"])
    except Exception as error:  # noqa: BLE001 (a corrupt entry of any kind)
        log.warning("tokenizer store: %s does not load (%s); rebuilding it", entry, error)
        entry.unlink(missing_ok=True)
        return None


def _load_and_store(path, entry: pathlib.Path):
    """transformers' tokenizer of ``path``, its pipeline stored in ``entry`` where it can be."""
    tokenizer = load_tokenizer(path)
    pipeline = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(pipeline, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        _write(entry, dict(format=FORMAT, pipeline=pipeline.to_str(), eos_token_id=tokenizer.eos_token_id))
    return tokenizer


def _entry(path, cache_dir) -> pathlib.Path:
    return pathlib.Path(cache_dir).expanduser() / "tokenizers" / f"{_key(path)}.json"


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


if __name__ == "__main__":  # the child of ``start_engine_tokenizer``: PATH ENTRY
    _load_and_store(sys.argv[1], pathlib.Path(sys.argv[2]))
