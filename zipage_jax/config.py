"""Engine configuration: one frozen, validated dataclass; vLLM's names where vLLM has one."""

import dataclasses
import os

from zipage_jax.compression.scoring import POLICIES as EVICTION_POLICIES, REDUNDANCY_MODES

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it starts. Invalid values raise ``ValueError`` naming the field."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    block_size: int = 256
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_num_prefill_seqs: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = os.path.join("~", ".cache", "zipage_jax", "xla")
    # Compressed PagedAttention (off = full-KV mode, the vLLM-like baseline)
    compression: bool = False
    kv_budget_blocks: int = 8
    eviction_policy: str = "zipage"
    window: int = 16
    sink_tokens: int = 0
    global_score: bool = True
    decay: float = 0.8
    pooling: bool = True
    pooling_width: int = 5
    pooling_first_only: bool = True
    redundancy: str = "lightning"
    redundancy_weight: float = 0.8
    similarity_threshold: float = 0.5
    redundancy_temperature: float = 0.4
    # Scheduling of compressed requests (DESIGN §3.6-3.7)
    num_query_slots: int | None = None  # C; None = as many as the memory sizing allows
    hybrid_admission: bool = True
    async_compression: bool = True
    max_compression_pages: int | None = None  # None = derived at start-up (see kv_cache.plan_memory)
    metrics_interval_steps: int = 16

    def __post_init__(self):
        def check(ok, field, why):
            if not ok:
                raise ValueError(f"{field}: {why} (got {getattr(self, field)!r})")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        check(isinstance(self.model, str) and self.model, "model", "must be a non-empty path or name")
        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        check(is_int(self.block_size) and 16 <= self.block_size <= 256
              and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two in [16, 256]")
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
        check(self.num_gpu_blocks_override is None or (is_int(self.num_gpu_blocks_override)
                                                       and self.num_gpu_blocks_override >= 2),
              "num_gpu_blocks_override", "must be an int >= 2 (page 0 is reserved) or None")
        check(is_int(self.seed), "seed", "must be an int")
        check(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size", "must be a positive int")
        check(isinstance(self.attention_backend, str), "attention_backend", "must be a string")
        check(isinstance(self.compression, bool), "compression", "must be a bool")
        check(is_int(self.kv_budget_blocks) and self.kv_budget_blocks >= 1, "kv_budget_blocks", "must be an int >= 1")
        check(self.eviction_policy in EVICTION_POLICIES, "eviction_policy", f"must be one of {EVICTION_POLICIES}")
        check(is_int(self.window) and 1 <= self.window <= self.block_size, "window",
              "must be an int in [1, block_size]")
        check(is_int(self.sink_tokens) and self.sink_tokens >= 0, "sink_tokens", "must be an int >= 0")
        check(self.sink_tokens + self.window <= self.kv_budget_blocks * self.block_size, "sink_tokens",
              "sink_tokens + window must fit in kv_budget_blocks * block_size")
        for name in ("global_score", "pooling", "pooling_first_only"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(isinstance(self.decay, (int, float)) and 0 <= self.decay <= 1, "decay", "must be in [0, 1]")
        check(is_int(self.pooling_width) and self.pooling_width >= 1 and self.pooling_width % 2 == 1,
              "pooling_width", "must be a positive odd int")
        check(self.redundancy in REDUNDANCY_MODES, "redundancy", f"must be one of {REDUNDANCY_MODES}")
        check(isinstance(self.redundancy_weight, (int, float)) and 0 <= self.redundancy_weight <= 1,
              "redundancy_weight", "must be in [0, 1]")
        check(isinstance(self.similarity_threshold, (int, float)) and -1 <= self.similarity_threshold <= 1,
              "similarity_threshold", "must be in [-1, 1]")
        check(isinstance(self.redundancy_temperature, (int, float)) and self.redundancy_temperature > 0,
              "redundancy_temperature", "must be > 0")

        check(self.num_query_slots is None or (is_int(self.num_query_slots)
                                               and 1 <= self.num_query_slots <= self.max_num_seqs),
              "num_query_slots", "must be None or an int in [1, max_num_seqs]")
        for name in ("hybrid_admission", "async_compression"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(self.max_compression_pages is None or (is_int(self.max_compression_pages)
                                                     and self.max_compression_pages >= 1),
              "max_compression_pages", "must be a positive int or None")
        check(is_int(self.metrics_interval_steps) and self.metrics_interval_steps >= 0,
              "metrics_interval_steps", "must be an int >= 0 (0 = no history)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from engine kwargs; an unknown key raises ``TypeError`` listing the valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)
