"""Compiled programs kept on disk, so a warm start neither traces nor compiles (docs/ARCHITECTURE.md, Compiled
programs).

jax's persistent compilation cache saves the XLA compile of a warm start, but each program is still traced and
lowered (about a second each for a 36-layer model, serially) to find its cache key. This store keys a program by
what shapes it instead — the engine's fingerprint (the source of the package and the kernels, jax and the device,
the model and every engine setting the programs see) and the program's own key, arguments and compiler options —
and keeps the serialized executable (``jax.experimental.serialize_executable``), which loads without tracing.

An entry is a header (magic, format version, SHA-256 of the payload) and the pickled executable. One that fails
its checksum or fails to load is deleted and reported as missing, so the program compiles again: a stale or
corrupt entry is never used.
"""

import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

MAX_BYTES = 8 * 2**30  # beyond this the least recently used entries go (other versions, other settings)
MAGIC = b"ZJXEXE"
FORMAT = 1
_DIGEST = hashlib.sha256().digest_size


@functools.cache  # the sources do not change under a running process: hashed once, not per engine
def source_fingerprint(*packages: str) -> str:
    """SHA-256 over the Python sources of ``packages`` (path and bytes of every ``.py`` file): a change of the code
    that builds a program changes every key."""
    digest = hashlib.sha256()
    for package in packages:
        root = pathlib.Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def runtime_fingerprint(mesh) -> dict:
    """jax, jaxlib, the backend and the devices the programs were compiled for."""
    devices = list(mesh.devices.flat)
    first = devices[0]
    return dict(jax=jax.__version__, jaxlib=jax.lib.__version__, platform=first.platform,
                platform_version=first.client.platform_version, device_kinds=sorted({d.device_kind for d in devices}),
                mesh=dict(mesh.shape), process_count=jax.process_count())


# EngineConfig fields no program sees (host-side settings); every other field is part of the fingerprint
HOST_ONLY_FIELDS = frozenset({"model", "tokenizer", "seed", "compilation_cache_dir", "metrics_interval_steps",
                              "coordinator_address", "process_id"})


def engine_fingerprint(config, model_cfg, backend_name: str, mesh) -> str:
    """What every program of one engine shares: the code, the runtime, the model, the settings and the backend."""
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in HOST_ONLY_FIELDS}
    flags = {name: getattr(jax.config, name) for name in ("jax_enable_x64", "jax_default_matmul_precision")}
    text = repr((source_fingerprint("zipage_jax", "pallas_kernels"), runtime_fingerprint(mesh), repr(model_cfg),
                 sorted(settings.items()), backend_name, flags))
    return hashlib.sha256(text.encode()).hexdigest()


def abstract_signature(args) -> str:
    """Shapes, dtypes and shardings of a program's arguments (their values never shape a program)."""
    def describe(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
        return repr(x)

    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [describe(x) for x in leaves]))


class ExecutableStore:
    """Serialized executables under ``directory``, keyed by ``fingerprint`` plus each program's own key, for the
    programs of one device assignment (``devices``, in mesh order; default: the first device)."""

    def __init__(self, directory: str, fingerprint: str, devices=None):
        self.directory = pathlib.Path(os.path.expanduser(directory))
        self.fingerprint = fingerprint
        self.devices = list(devices) if devices is not None else jax.devices()[:1]
        self.loaded = self.saved = self.rejected = 0
        self._count = threading.Lock()  # loads and saves run on several threads at once

    def key(self, program) -> str:
        text = repr((self.fingerprint, program.key, abstract_signature(program.args), sorted(program.static.items()),
                     sorted((program.options or {}).items())))
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, program) -> pathlib.Path:
        return self.directory / f"{self.key(program)}.exe"

    def load(self, program):
        """The stored executable of ``program``, or None (absent, corrupt or unloadable: then deleted)."""
        path = self.path(program)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            payload = _unwrap(blob)
            compiled = serialize_executable.deserialize_and_load(*pickle.loads(payload),
                                                                 execution_devices=self.devices)
        except Exception as exc:  # noqa: BLE001 - any failure means: compile it again
            log.warning("executable store: dropping %s (%s: %s); compiling %s again", path.name,
                        type(exc).__name__, exc, program.name)
            with self._count:
                self.rejected += 1
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: pruned last
        with self._count:
            self.loaded += 1
        return compiled

    def save(self, program, compiled):
        """Keep ``compiled``; a failure to serialize or write is logged and otherwise ignored (the program works)."""
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, suffix=".tmp") as f:
                f.write(_wrap(payload))
            os.replace(f.name, self.path(program))  # atomic: a reader sees a whole entry or none
        except Exception as exc:  # noqa: BLE001
            log.warning("executable store: could not keep %s (%s: %s)", program.name, type(exc).__name__, exc)
            return
        with self._count:
            self.saved += 1
        self.prune()

    def prune(self, max_bytes: int = MAX_BYTES):
        """Delete the least recently used entries while the store holds more than ``max_bytes``."""
        entries = []
        for path in self.directory.glob("*.exe"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another engine pruned it
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def _wrap(payload: bytes) -> bytes:
    return MAGIC + bytes([FORMAT]) + hashlib.sha256(payload).digest() + payload


def _unwrap(blob: bytes) -> bytes:
    head = len(MAGIC) + 1
    if blob[:len(MAGIC)] != MAGIC or blob[len(MAGIC)] != FORMAT:
        raise ValueError("not an executable of this format")
    digest, payload = blob[head:head + _DIGEST], blob[head + _DIGEST:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch")
    return payload
