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
    dtype: np.dtype  # the model's: of the query cache (and of the KV pool unless kv_dtype says otherwise)
    kv_dtype: np.dtype  # of the KV pool pages (kv_cache_dtype: FP8, else the model's)
    budget_source: str  # num_gpu_pages_override, kv_cache_memory_bytes, gpu_memory_utilization or cpu_default
    budget_bytes: int | None
    card_bytes: int | None  # the device's memory (None: it reports none, as on CPU)
    share_bytes: int | None  # what the engine may fill: gpu_memory_utilization of the card, within the allocator
    weights_bytes: int | None  # allocated when the plan was made: the weights
    headroom_bytes: int | None  # what the plan leaves free in the share: room for what the scratch estimates miss
    held_bytes: int | None  # in use beside the weights by others when the plan was made, left out of the pool
    reserved_step_scratch_bytes: int
    reserved_compression_scratch_bytes: int
    reserved_swap_bytes: int
    step_scratch_bytes: int
    compression_scratch_bytes: int
    swap_bytes: int  # device staging of one request's swap-in (compression only)
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

    @property
    def scratch_bytes(self) -> int:
        """The step, compression and swap scratch a full pool must leave room for."""
        return self.step_scratch_bytes + self.compression_scratch_bytes + self.swap_bytes

    def describe(self) -> str:
        """The plan in one line (the engine logs it at start)."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        pool = f"KV pool {gib(self.pool_bytes)} ({self.num_pages} pages of {np.dtype(self.kv_dtype).name})"
        if self.query_cache_bytes:
            pool += f" + query cache {gib(self.query_cache_bytes)} ({self.num_query_rows} rows)"
        if self.card_bytes is None:
            memory = f"{pool} from {self.budget_source}"
        else:
            memory = (f"card {gib(self.card_bytes)}, engine share {gib(self.share_bytes)}: weights "
                      f"{gib(self.weights_bytes)}, {pool} from {self.budget_source}, scratch "
                      f"{gib(self.scratch_bytes)}, headroom {gib(self.headroom_bytes)}")
            if self.held_bytes:
                memory += f", other arrays {gib(self.held_bytes)}"
        compressed = f"{self.max_compressed_concurrency} compressed, " if self.num_query_rows else ""
        return (f"{memory}; max concurrency {self.max_concurrency} ({compressed}{self.full_length_concurrency} at "
                f"full length {self.max_model_len})")

    def as_dict(self) -> dict:
        """The plan as JSON-ready numbers (the dtypes by name)."""
        return {**dataclasses.asdict(self), "dtype": np.dtype(self.dtype).name, "kv_dtype": np.dtype(self.kv_dtype).name}
