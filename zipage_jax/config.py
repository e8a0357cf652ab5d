"""Engine configuration: one frozen, validated dataclass; vLLM's names where vLLM has one.

``DESCRIPTIONS`` holds the one description of each field: the server's and eval's ``--help``
(``add_engine_options``) and the README's configuration reference (``reference_table``) come from it.
"""

import argparse
import dataclasses
import os
import pathlib
import re
import types
import typing

DEFAULT_MODEL = str(pathlib.Path(__file__).parent / "assets" / "tiny-reasoner")  # the shipped model
DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings
ADMISSIONS = ("reserved", "hybrid", "constrained")  # see the `admission` field
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype; fp8 = fp8_e4m3


EVICTION_POLICIES = ("zipage", "window", "triattention")
REDUNDANCY_MODES = ("off", "lightning", "full")


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """Static scoring knobs (hashable: a jit static argument), nested once in ``EngineConfig.scoring``, which
    validates them; the engine's kwargs and CLI flags name them flat (``eviction_policy=``, ``--window``)."""

    eviction_policy: str = "zipage"
    window: int = 16
    sink_tokens: int = 0
    global_score: bool = True
    decay: float = 0.5  # the paper: 0.8, which 0.5 matched or beat in 11 of 12 accuracy-lab cells (README)
    pooling: bool = True
    pooling_width: int = 5
    pooling_first_only: bool = True
    redundancy: str = "lightning"
    redundancy_weight: float = 0.8
    similarity_threshold: float = 0.5
    redundancy_temperature: float = 0.4

    @property
    def tracks_history(self) -> bool:
        """Whether a compression reads (decayed history) and writes (kept slots' scores) the score cache."""
        return self.eviction_policy == "zipage" and self.global_score

    @property
    def reads_window_queries(self) -> bool:
        """Whether a compression scores with the recent queries (attention scores); the window and query-free
        policies score from the keys alone."""
        return self.eviction_policy == "zipage"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it starts. Invalid values raise ``ValueError`` naming the field."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 256
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_num_prefill_seqs: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_pages_override: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    # Several hosts (README, Several GPUs and hosts): every process joins through jax.distributed first
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = os.path.join("~", ".cache", "zipage_jax", "xla")
    # Compressed PagedAttention (off = full-KV mode, the vLLM-like baseline)
    compression: bool = False
    kv_budget_pages: int = 8
    scoring: ScoringConfig = ScoringConfig()  # eviction policy and its knobs; kwargs and flags name them flat
    # Scheduling of compressed requests (docs/ARCHITECTURE.md, Compression: concurrency)
    num_query_rows: int | None = None  # C; None = as many as the memory sizing allows
    admission: str = "reserved"
    async_compression: bool = True
    max_compression_pages: int | None = None  # None = derived at start-up (see kv_cache.plan_memory)
    compression_min_batch: int = 4
    compression_max_wait_steps: int = 4
    metrics_interval_steps: int = 16

    def __post_init__(self):
        def check(ok, field, why):
            if not ok:
                value = getattr(self.scoring if field in SCORING_FIELDS else self, field)
                raise ValueError(f"{field}: {why} (got {value!r})")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        check(isinstance(self.model, str) and self.model, "model", "must be a non-empty path or name")
        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        check(is_int(self.page_size) and 16 <= self.page_size <= 256
              and self.page_size & (self.page_size - 1) == 0, "page_size", "must be a power of two in [16, 256]")
        check(self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 1),
              "max_model_len", "must be a positive int or None")
        check(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "must be a positive int")
        check(is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 16,
              "max_num_batched_tokens", "must be an int >= 16")
        check(is_int(self.max_num_prefill_seqs) and self.max_num_prefill_seqs >= 1,
              "max_num_prefill_seqs", "must be a positive int")
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be a bool")
        check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", "must be in (0, 1]")
        check(self.kv_cache_memory_bytes is None or (is_int(self.kv_cache_memory_bytes)
                                                     and self.kv_cache_memory_bytes > 0),
              "kv_cache_memory_bytes", "must be a positive int or None")
        check(self.num_gpu_pages_override is None or (is_int(self.num_gpu_pages_override)
                                                      and self.num_gpu_pages_override >= 2),
              "num_gpu_pages_override", "must be an int >= 2 (page 0 is reserved) or None")
        check(is_int(self.seed), "seed", "must be an int")
        check(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size", "must be a positive int")
        check(self.coordinator_address is None or _is_host_port(self.coordinator_address), "coordinator_address",
              "must be 'host:port' (port 1-65535) or None")
        multi_host = self.coordinator_address is not None
        check(self.num_processes is None or (is_int(self.num_processes) and self.num_processes >= 1),
              "num_processes", "must be a positive int or None")
        check((self.num_processes is None) != multi_host, "num_processes",
              "must be given with coordinator_address, and only with it")
        check(self.process_id is None or (is_int(self.process_id) and 0 <= self.process_id
                                          < (self.num_processes or self.process_id + 1)),
              "process_id", "must be an int in [0, num_processes) or None")
        check((self.process_id is None) != multi_host, "process_id",
              "must be given with coordinator_address, and only with it")
        check(isinstance(self.attention_backend, str), "attention_backend", "must be a string")
        check(isinstance(self.compression, bool), "compression", "must be a bool")
        check(is_int(self.kv_budget_pages) and self.kv_budget_pages >= 1, "kv_budget_pages", "must be an int >= 1")
        check(isinstance(self.scoring, ScoringConfig), "scoring", "must be a ScoringConfig")
        sc = self.scoring
        check(sc.eviction_policy in EVICTION_POLICIES, "eviction_policy", f"must be one of {EVICTION_POLICIES}")
        check(is_int(sc.window) and 1 <= sc.window <= self.page_size, "window", "must be an int in [1, page_size]")
        check(is_int(sc.sink_tokens) and sc.sink_tokens >= 0, "sink_tokens", "must be an int >= 0")
        check(sc.sink_tokens + sc.window <= self.kv_budget_pages * self.page_size, "sink_tokens",
              "sink_tokens + window must fit in kv_budget_pages * page_size")
        for name in ("global_score", "pooling", "pooling_first_only"):
            check(isinstance(getattr(sc, name), bool), name, "must be a bool")
        check(isinstance(sc.decay, (int, float)) and 0 <= sc.decay <= 1, "decay", "must be in [0, 1]")
        check(is_int(sc.pooling_width) and sc.pooling_width >= 1 and sc.pooling_width % 2 == 1,
              "pooling_width", "must be a positive odd int")
        check(sc.redundancy in REDUNDANCY_MODES, "redundancy", f"must be one of {REDUNDANCY_MODES}")
        check(isinstance(sc.redundancy_weight, (int, float)) and 0 <= sc.redundancy_weight <= 1,
              "redundancy_weight", "must be in [0, 1]")
        check(isinstance(sc.similarity_threshold, (int, float)) and -1 <= sc.similarity_threshold <= 1,
              "similarity_threshold", "must be in [-1, 1]")
        check(isinstance(sc.redundancy_temperature, (int, float)) and sc.redundancy_temperature > 0,
              "redundancy_temperature", "must be > 0")

        check(self.num_query_rows is None or (is_int(self.num_query_rows)
                                              and 1 <= self.num_query_rows <= self.max_num_seqs),
              "num_query_rows", "must be None or an int in [1, max_num_seqs]")
        check(self.admission in ADMISSIONS, "admission", f"must be one of {ADMISSIONS}")
        check(isinstance(self.async_compression, bool), "async_compression", "must be a bool")
        check(self.max_compression_pages is None or (is_int(self.max_compression_pages)
                                                     and self.max_compression_pages >= 1),
              "max_compression_pages", "must be a positive int or None")
        check(is_int(self.compression_min_batch) and self.compression_min_batch >= 1, "compression_min_batch",
              "must be an int >= 1")
        check(is_int(self.compression_max_wait_steps) and self.compression_max_wait_steps >= 0,
              "compression_max_wait_steps", "must be an int >= 0")
        check(is_int(self.metrics_interval_steps) and self.metrics_interval_steps >= 0,
              "metrics_interval_steps", "must be an int >= 0 (0 = no history)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat engine kwargs (``window=8`` fills ``scoring.window``); an unknown key raises
        ``TypeError`` listing the valid ones."""
        unknown = sorted(set(kwargs) - set(option_fields()) - {"scoring"})
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(option_fields())}")
        knobs = {name: kwargs.pop(name) for name in SCORING_FIELDS if name in kwargs}
        scoring = dataclasses.replace(kwargs.pop("scoring", ScoringConfig()), **knobs)
        return cls(model=model, scoring=scoring, **kwargs)

    @property
    def tracks_history(self) -> bool:
        """Whether the engine keeps a score cache: compression on, with scoring that tracks a history. Its
        allocation, its share of the memory plan and its swaps all follow this one answer."""
        return self.compression and self.scoring.tracks_history

    @property
    def stores_window_queries(self) -> bool:
        """Whether the steps record each query-row holder's window queries: only for a policy that reads them, so
        the others' query rows cost no memory (a row still commits its holder's pages: ``core.query_rows``)."""
        return self.compression and self.scoring.reads_window_queries

    def context_length(self, model_context: int) -> int:
        """``max_model_len``, or the model's context (``model_context``) where unset; longer than it is a
        ``ValueError``."""
        if self.max_model_len is not None and self.max_model_len > model_context:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's context of {model_context}")
        return self.max_model_len or model_context

    def options(self) -> dict:
        """The config as flat engine options (the inverse of ``from_kwargs``), ``model`` first: what reports
        record."""
        return {"model": self.model, **{name: getattr(self.scoring if name in SCORING_FIELDS else self, name)
                                        for name in option_fields()}}


def _is_host_port(address) -> bool:
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


SCORING_FIELDS = tuple(f.name for f in dataclasses.fields(ScoringConfig))


def option_fields() -> dict:
    """The flat engine options, in order, name -> dataclass field: EngineConfig's except ``model``, with the
    ``scoring`` field expanded into ScoringConfig's. Every CLI, ``from_kwargs`` and the README table use them."""
    fields = {}
    for field in dataclasses.fields(EngineConfig):
        if field.name == "scoring":
            fields.update((f.name, f) for f in dataclasses.fields(ScoringConfig))
        elif field.name != "model":
            fields[field.name] = field
    return fields


DESCRIPTIONS = {
    "model": "HF checkpoint directory (config.json, safetensors, tokenizer) or Hugging Face Hub id",
    "tokenizer": "tokenizer directory or Hub id; None = the model's",
    "dtype": "`auto` (the checkpoint's), `bfloat16`, `float16` (or `half`), `float32` (or `float`)",
    "kv_cache_dtype": "KV pool pages: `auto` (the model's dtype), `fp8` (= `fp8_e4m3`) or `fp8_e5m2`: one byte a "
                      "value, static per-(layer, KV head) scales calibrated at start-up",
    "page_size": "tokens per KV page (a power of two in 16-256); also the eviction quantum",
    "max_model_len": "longest prompt + output in tokens; None = the model's context",
    "max_num_seqs": "most running requests (decode batch sizes are compiled up to it)",
    "max_num_batched_tokens": "token budget of one step (chunked prefill; prefill sizes are compiled up to it)",
    "max_num_prefill_seqs": "most prompt chunks in one step",
    "enable_prefix_caching": "share full prompt pages by a hash chain",
    "gpu_memory_utilization": "share of each device's memory the engine uses for weights, KV pool and scratch (as "
                              "in vLLM; jax's allocator is set to it unless `XLA_CLIENT_MEM_FRACTION` is set)",
    "kv_cache_memory_bytes": "KV pool size in bytes (per device) instead; must fit beside weights and scratch",
    "num_gpu_pages_override": "KV pool size in pages instead; must fit likewise",
    "seed": "engine seed: seeds of requests that bring none",
    "tensor_parallel_size": "devices to shard heads and MLP over (across hosts: every device of every process)",
    "coordinator_address": "several hosts: `host:port` of process 0, where every process joins "
                           "(`jax.distributed.initialize`); None = one process",
    "num_processes": "several hosts: how many processes join (with `coordinator_address`)",
    "process_id": "several hosts: this process's rank in [0, `num_processes`) (with `coordinator_address`)",
    "attention_backend": "`auto` (Mosaic GPU on Hopper, Triton through jax-triton on compute capability 8.x, "
                         "reference on CPU), `mosaic`, `mosaic_decode` (Mosaic decode, XLA prefill), `triton`, "
                         "`reference`",
    "compilation_cache_dir": "where the compiled programs are kept (serialized executables, keyed by the code, "
                             "jax, the device, the model and these settings) and the tokenizer's Rust pipeline: a "
                             "warm start loads them without tracing, compiling or importing transformers; None = "
                             "compile every start",
    "compression": "Compressed PagedAttention on/off (off = full-KV mode)",
    "kv_budget_pages": "budget `M`: a request holds at most `M+1` pages after its first compression",
    "eviction_policy": "`zipage` (attention scores), `window` (sinks + most recent tokens) or `triattention` "
                       "(scores without queries: calibrated centres of the queries before RoPE, the model's "
                       "`query_centres.npz`)",
    "window": "`W` recent queries that score; the last `W` slots are never evicted",
    "sink_tokens": "first tokens never evicted",
    "global_score": "combine scores with their decayed history: `G = max(A, decay * G_old)` from the score cache",
    "decay": "decay of the score history (the paper: 0.8; 0.5 matched or beat it in 11 of 12 accuracy-lab cells)",
    "pooling": "max-pool scores along slots",
    "pooling_width": "max-pooling width (odd)",
    "pooling_first_only": "pool only at a request's first compression",
    "redundancy": "key-redundancy penalty: `off`, `lightning` (within a page), `full`",
    "redundancy_weight": "`1 - lambda` in `S = lambda * P - (1 - lambda) * R`",
    "similarity_threshold": "cosine similarity above which keys count as duplicates",
    "redundancy_temperature": "softmax temperature of the redundancy penalty",
    "num_query_rows": "`C`, requests that may hold window queries (compress); None = sized from memory so every "
                       "holder fits `M+1` pages (the `window` and `triattention` policies record no queries: a row "
                       "then costs no memory)",
    "admission": "`reserved`: requests without a query row run until the window of their first compression, "
                 "then stall until a query row frees, admitted only while the pages they can hold before it fit; "
                 "`hybrid`: the same, admitted greedily (may thrash by recompute preemption); `constrained`: only "
                 "query-row holders run",
    "async_compression": "the host never waits for a compression (dispatched first in its step, its requests "
                         "decode in the same step); False = the host waits for it (timed)",
    "max_compression_pages": "most (padded) source pages in one compression dispatch, the scratch reserved up "
                             "front; None = max(pages of `max_model_len`, min(`max_num_seqs`, 64) * (M+1))",
    "compression_min_batch": "due compressions wait (their requests skip decode steps) until this many are due "
                             "together, so fewer dispatches serve them",
    "compression_max_wait_steps": "most steps a due compression waits for `compression_min_batch` (0 = never waits)",
    "metrics_interval_steps": "steps between samples of `LLMEngine.metrics_history()` (0 = off)",
}


def _field_type(hint):
    """(scalar type, accepts None) of an EngineConfig annotation such as `int`, `str | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """An int, or a size with vLLM's suffixes: ``32k`` = 32000, ``1.5m`` = 1500000 (decimal, lower case), ``32K`` =
    32768, ``2G`` = 2**31 (binary, upper case, whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix.isupper() and "." in number:
        raise ValueError(f"{text}: a binary suffix takes a whole number")
    return round(float(number) * _SIZE_SUFFIXES[suffix])


human_int.__name__ = "int"  # argparse names the type in its error messages


def _optional(kind):
    def convert(text: str):
        return None if text.lower() == "none" else kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in its error messages
    return convert


def add_engine_options(parser: argparse.ArgumentParser, exclude=(), defaults: dict | None = None,
                       aliases: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """One option per engine option (``option_fields``; bools as --flag/--no-flag), described by
    ``DESCRIPTIONS``; unset options stay out of the namespace and keep the engine's default (so 'none' can
    unset a field whose default is not None). Ints take human sizes (``human_int``: ``32k``). A command may leave
    out the options it sets itself (``exclude``), give its own defaults (``defaults``: shown in --help and set in
    the namespace) and other spellings of a flag (``aliases``: field -> option strings, e.g. vLLM's
    ``--block-size``). Returns the option names."""
    defaults, aliases = defaults or {}, aliases or {}
    unknown = sorted((set(exclude) | set(defaults) | set(aliases)) - set(option_fields()))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}")
    group = parser.add_argument_group("engine (EngineConfig fields; unset = the engine's default)")
    hints = {**typing.get_type_hints(EngineConfig), **typing.get_type_hints(ScoringConfig)}
    names = []
    for name, field in option_fields().items():
        if name in exclude:
            continue
        kind, nullable = _field_type(hints[name])
        flags = ["--" + name.replace("_", "-"), *aliases.get(name, ())]
        kind = human_int if kind is int else kind
        default = defaults.get(name, argparse.SUPPRESS)
        text = (f"{DESCRIPTIONS[name]} (default: {defaults.get(name, field.default)}"
                + ("; 'none' to unset)" if nullable else ")")).replace("%", "%%").replace("`", "")
        if kind is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            group.add_argument(*flags, dest=name, type=_optional(kind) if nullable else kind, default=default,
                               metavar=kind.__name__.upper(), help=text)
        names.append(name)
    return names


def engine_kwargs(args: argparse.Namespace, names: list[str]) -> dict:
    """The engine options ``names`` (from ``add_engine_options``) that were set on the command line."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def option_error(parser: argparse.ArgumentParser, error: ValueError):
    """Exit with status 2 and one line, ``PROG: error: --option: why``, for a ``field: why`` ValueError (the
    config's and the engine's errors name their field); the usage is left out: the option says what is wrong."""
    field, _, why = str(error).partition(":")
    message = f"--{field.strip().replace('_', '-')}: {why.strip()}" if why and field.isidentifier() else str(error)
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def reference_table() -> str:
    """The README's configuration reference: one markdown row per field."""
    def default(value):
        return f"`{value}`" if isinstance(value, str) else str(value)

    rows = ["| field | default | meaning |", "|---|---|---|",
            f"| `model` | shipped tiny model | {DESCRIPTIONS['model']} |"]
    rows += [f"| `{name}` | {default(f.default)} | {DESCRIPTIONS[name]} |" for name, f in option_fields().items()]
    return "\n".join(rows)
