"""Engine configuration: one frozen, validated dataclass; vLLM's names where vLLM has one."""

import dataclasses
import os

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

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from engine kwargs; an unknown key raises ``TypeError`` listing the valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)
