"""The memory plan: how the KV pool, the query rows and the scratch split the memory budget (``worker.kv_cache``
decides it; the scheduler and the metrics read it). Plain data, no jax."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``plan_memory`` decided: the pool, the query rows and the concurrency they allow, and the bytes
    behind each (the engine logs them; the server's metrics report them). Bytes are per device: under tensor
    parallelism each device holds its share of the heads of every page and query row."""

    max_model_len: int
    dtype: np.dtype  # of the KV pool and the query cache
    budget_source: str  # num_gpu_pages_override, kv_cache_memory_bytes, device or cpu_default
    budget_bytes: int | None
    reserved_step_scratch_bytes: int
    reserved_compression_scratch_bytes: int
    reserved_swap_bytes: int
    step_scratch_bytes: int
    compression_scratch_bytes: int
    page_bytes: int
    num_pages: int
    pool_bytes: int
    query_row_bytes: int
    num_query_rows: int  # C (0 with compression off): the one place this is decided
    query_cache_bytes: int
    max_compression_pages: int  # 0 with compression off
    pages_per_seq: int
    max_concurrency: int
    max_compressed_concurrency: int
    full_length_concurrency: int

    def as_dict(self) -> dict:
        """The plan as JSON-ready numbers (the dtype by name)."""
        return {**dataclasses.asdict(self), "dtype": np.dtype(self.dtype).name}
