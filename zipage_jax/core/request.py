"""Host-side state of one request: tokens, pages and progress. Plain Python, no device arrays."""

import enum

PENDING = -1  # placeholder for a token sampled on the device but not read back yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # compressed, its pages and window queries held in host memory until it resumes
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One generation request.

    ``output_token_ids`` may end with ``PENDING`` placeholders (asynchronous read-back; only the methods below
    add and resolve them); ``num_computed_tokens`` counts tokens whose K/V is in the pool, including those of a
    step already dispatched.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params, arrival: int,
                 prompt: str | None = None, seed: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival = arrival
        self.seed = seed
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.page_ids: list[int] = []
        self.page_hashes: list[int] = []  # chain hashes of the leading full pages (prefix cache)
        self.status = RequestStatus.WAITING
        self.token_row: int | None = None  # row of the device token buffer while running
        self.query_row: int | None = None  # row of the query cache; needed before the window of a compression
        self.swap_pages = 0  # pages held in host memory while swapped out
        self.swap_state = None  # those pages' K/V/scores and the window queries (host arrays)
        self.peak_pages = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_evicted = 0  # tokens dropped by compression: physical length = computed - evicted
        self.num_compressions = 0
        self.peak_pages_after_compression = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    # -- the asynchronous read-back: tokens on the device are PENDING until the next step reads them -----------
    @property
    def num_pending(self) -> int:
        return len(self.output_token_ids) - len(self.output_logprobs)

    def add_pending(self):
        """A step sampling this request's next token was dispatched."""
        self.output_token_ids.append(PENDING)

    def resolve_pending(self, token: int, logprob: float) -> int:
        """Read back the oldest pending token (they resolve in dispatch order); returns the tokens now known."""
        index = len(self.output_logprobs)
        assert self.output_token_ids[index] == PENDING
        self.output_token_ids[index] = token
        self.output_logprobs.append(logprob)
        return index + 1

    def drop_pending(self):
        """Forget the tokens still on the device (the request finished: nobody reads them)."""
        del self.output_token_ids[len(self.output_logprobs):]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """Token ``index`` of prompt + output without building the concatenation (hot path)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:n] + self.output_token_ids[max(start - n, 0):stop - n]

    @property
    def num_physical_tokens(self) -> int:
        """Live KV slots: equals the logical length until the first compression."""
        return self.num_computed_tokens - self.num_evicted

    @property
    def compressed(self) -> bool:
        """Has evicted tokens (a recompute after preemption starts uncompressed again)."""
        return self.num_evicted > 0

    def kv_budget(self, default: int) -> int:
        budget = self.sampling_params.kv_budget_pages
        return default if budget is None else budget

    @property
    def reached_max_tokens(self) -> bool:
        return len(self.output_token_ids) >= self.sampling_params.max_tokens

    def note_pages(self):
        self.peak_pages = max(self.peak_pages, len(self.page_ids))
        if self.compressed:
            self.peak_pages_after_compression = max(self.peak_pages_after_compression, len(self.page_ids))
