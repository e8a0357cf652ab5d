"""The ``C`` query rows: a request must hold one to be compressed (the device records window queries only for the
holders), and holding one commits its ``M + 1`` steady-state pages. A row is granted only while the committed
pages of every holder still fit in the pool, so every holder can always be compressed down to its budget."""


class QueryRows:
    def __init__(self, num_rows: int, pool_pages: int):
        self.num_rows = num_rows
        self.pool_pages = pool_pages  # pages that can be committed (the pool less its null page)
        self.free = list(range(num_rows - 1, -1, -1))
        self.committed_pages = 0  # sum of M+1 over the holders

    @property
    def num_used(self) -> int:
        return self.num_rows - len(self.free)

    def grant(self, request, budget: int) -> bool:
        """Give ``request`` (budget ``M``) a row if one is free and its ``M+1`` pages fit beside the others'."""
        if not self.free or self.committed_pages + budget + 1 > self.pool_pages:
            return False
        request.query_row = self.free.pop()
        self.committed_pages += budget + 1
        return True

    def release(self, request, budget: int):
        if request.query_row is not None:
            self.free.append(request.query_row)
            self.committed_pages -= budget + 1
            request.query_row = None
