"""When the due compressions of a step are dispatched. A dispatch has a fixed cost (every layer's kernels) whatever
its rows, and with many query-row holders about one request falls due each step; so due compressions may wait for
company: they go once ``min_batch`` requests (or every query-row holder) are due together, or once one has waited
``max_wait_steps`` steps. Meanwhile the due requests stall."""


class CompressionBatching:
    def __init__(self, enabled: bool, min_batch: int, max_wait_steps: int):
        self.holds_back = enabled and max_wait_steps > 0 and min_batch > 1
        self.min_batch, self.max_wait_steps = min_batch, max_wait_steps
        self._step = 0
        self._due_since: dict[int, int] = {}  # id(request) -> step it became due, while its compression waits

    def dispatch_now(self, running: list, is_due) -> bool:
        """Count this step; whether the compressions due in it (``is_due(request)`` over the ``running`` query-row
        holders whose next token waits on one) are dispatched now."""
        self._step += 1
        if not self.holds_back:
            return True
        holders = [r for r in running if r.query_row is not None]
        due = [r for r in holders if not r.reached_max_tokens and r.num_tokens - r.num_computed_tokens == 1
               and is_due(r)]
        self._due_since = {id(r): self._due_since.get(id(r), self._step) for r in due}
        return len(due) >= min(self.min_batch, len(holders)) or any(
            self._step - since >= self.max_wait_steps for since in self._due_since.values())
