"""Admission under compression: how a request comes to hold a query row, which it needs before it computes the
last ``W`` tokens before its first compression (their window queries are what compression scores with).

| policy        | runs without a query row          | admitted while                                                |
|---------------|-----------------------------------|---------------------------------------------------------------|
| `reserved`    | until its window, then stalls     | its pages up to its first compression fit beside the ``M+1`` of |
|               | there until a query row frees     | every holder and the peaks of the other requests without one   |
| `hybrid`      | the same                          | pages and a token row are free                                |
| `constrained` | never: it takes a row or waits    | a query row is free (and pages and a token row)               |

Reserved admission (the default) keeps requests that run into their windows from thrashing the pool by recompute
preemption; hybrid admits more and lets preemption sort it out; constrained runs only what it can compress.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Admission:
    """One admission policy (the table above); ``ADMISSION`` has them by their ``EngineConfig.admission`` name."""

    name: str
    runs_without_query_row: bool
    reserves_pages: bool

    def reachable(self, scheduler, request, end: int) -> int:
        """The largest length ``<= end`` the request may reach without a query row."""
        if not self.runs_without_query_row:
            return request.num_computed_tokens
        return scheduler.end_without_query_row(request, end)

    def reservation(self, scheduler, request, rowless: int) -> int | None:
        """Pages the request reserves on admission beside the ``rowless`` pages the running requests without a query
        row can come to hold (0: this policy reserves none), or None: it does not fit now."""
        if not self.reserves_pages:
            return 0
        need = peak_pages_before_compression(scheduler, request)
        if scheduler.query_rows.committed_pages + rowless + need > scheduler.page_manager.num_pages - 1:
            return None
        return need


    @staticmethod
    def rowless_pages(scheduler) -> int:
        """Pages the running requests without a query row can come to hold (or hold, if more): once one takes a
        query row at its window, its ``M+1`` committed pages are no more than that."""
        return sum(max(len(r.page_ids), peak_pages_before_compression(scheduler, r))
                   for r in scheduler.running if r.query_row is None)


def peak_pages_before_compression(scheduler, request) -> int:
    """Pages the request holds at most before its first compression (or its end, if that comes first)."""
    end = min(len(request.prompt_token_ids) + request.sampling_params.max_tokens, scheduler.first_due(request))
    return -(-end // scheduler.page_manager.page_size)


ADMISSION = {policy.name: policy for policy in (
    Admission("reserved", runs_without_query_row=True, reserves_pages=True),
    Admission("hybrid", runs_without_query_row=True, reserves_pages=False),
    Admission("constrained", runs_without_query_row=False, reserves_pages=False),
)}
