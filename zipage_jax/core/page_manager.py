"""Host page pool: free list, reference counts and a prefix cache keyed by a hash chain over full pages.

Page 0 is the null page (padding writes land there) and is never handed out. A freed page whose contents are
hashed stays findable until it is reused (LRU order), so a later request with the same prefix still hits.
A step's compressions run before anything else the step writes into the pool (the worker dispatches them
first), so the pages they release go straight to the free list: whatever is written there later in the step
comes after the compaction read them. Within one step's compression batch, a copy-on-write target is never a page
another compression of the batch reads (the compaction kernel runs the requests concurrently, each in place; see
``pallas_kernels.compaction``).
"""

import collections

import numpy as np
import xxhash

NULL_PAGE = 0


def chain_hash(parent: int, tokens) -> int:
    """Hash of a full page given the hash of the page before it (so equal hashes mean equal prefixes)."""
    h = xxhash.xxh3_128()
    h.update(parent.to_bytes(16, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        self.free_pages: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages))
        self.compaction_sources: set[int] = set()  # pages read by this step's compressions: never their targets
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens served from the cache

    # -- queries -----------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - self.num_free_pages

    def pages_needed(self, request, num_new_tokens: int) -> int:
        want = -(-(request.num_physical_tokens + num_new_tokens) // self.page_size)
        return max(0, want - len(request.page_ids))

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- allocation --------------------------------------------------------------------------------------
    def _take_free_page(self, avoid=frozenset()) -> int:
        if avoid:
            page = next(p for p in self.free_pages if p not in avoid)
            del self.free_pages[page]
        else:
            page, _ = self.free_pages.popitem(last=False)
        self._unpublish(page)  # its cached contents are about to be overwritten
        self.ref_count[page] = 1
        return page

    def _ref(self, page: int):
        if self.ref_count[page] == 0:
            del self.free_pages[page]
        self.ref_count[page] += 1

    def match_prefix(self, request, limit: int | None = None) -> int:
        """Attach cached pages for the request's leading full pages; returns the number of tokens they cover.

        The page holding the last known token is never served from the cache: that token must be computed to
        produce logits. Nor is any page reaching past ``limit`` tokens (with compression: the start of the
        window whose queries the first compression scores with).
        """
        assert not request.page_ids and request.num_computed_tokens == 0
        tokens = request.all_token_ids
        self.prefix_queries += len(request.prompt_token_ids)
        if not self.enable_prefix_caching:
            return 0
        parent, hits, hashes = 0, [], []
        last = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
        for i in range(last // self.page_size):
            parent = chain_hash(parent, tokens[i * self.page_size:(i + 1) * self.page_size])
            hashes.append(parent)
            page = self.hash_to_page.get(parent)
            if page is None:
                break
            hits.append(page)
        for page in hits:
            self._ref(page)
        request.page_ids = hits
        request.page_hashes = hashes[:len(hits)]
        num_cached = len(hits) * self.page_size
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
        self.prefix_hits += min(num_cached, len(request.prompt_token_ids))
        request.note_pages()
        return num_cached

    def allocate(self, request, num_new_tokens: int) -> bool:
        """Give the request the pages its next ``num_new_tokens`` tokens need; all or nothing."""
        need = self.pages_needed(request, num_new_tokens)
        if need == 0:  # most decode steps: the token fits in the last page
            return True
        if need > self.num_free_pages:
            return False
        request.page_ids.extend(self._take_free_page() for _ in range(need))
        request.note_pages()
        return True

    def allocate_pages(self, n: int) -> list[int] | None:
        """``n`` private pages (a swap-in target), or None when there are fewer free."""
        if n > self.num_free_pages:
            return None
        return [self._take_free_page() for _ in range(n)]

    def new_step(self):
        """A new step: any free page may be a compression target again (last step's compactions precede it)."""
        self.compaction_sources.clear()

    def free(self, request):
        """Drop the request's references (last page first, so LRU eviction takes tails before heads)."""
        for page in reversed(request.page_ids):
            self._unref(page)
        request.page_ids = []
        request.page_hashes = []

    def _unpublish(self, page: int):
        old = self.page_hash[page]
        if old is not None:
            del self.hash_to_page[old]
            self.page_hash[page] = None

    def _unref(self, page: int):
        self.ref_count[page] -= 1
        assert self.ref_count[page] >= 0, f"page {page} freed twice"
        if self.ref_count[page] == 0:
            self.free_pages[page] = None

    def _private(self, page: int) -> int:
        """The page itself if only this request holds it (it stops being a cache entry), else a fresh copy target."""
        if self.ref_count[page] == 1:
            self._unpublish(page)
            return page
        self._unref(page)
        return self._take_free_page(avoid=self.compaction_sources)

    def allocate_compaction(self, request, budget: int):
        """Give the request the pages of its compaction into ``budget`` pages plus a recent page.

        Returns ``(src_pages, dst_pages)`` — the live pages read, the pages the kept slots are written to — or
        None when copy-on-write of shared pages needs more free pages than there are. Shared pages are only
        read (they lose this request's reference); pages in between are released, still findable by hash.
        """
        src = list(request.page_ids)
        cow = sum(self.ref_count[p] > 1 for p in src[:budget]) + (self.ref_count[src[-1]] > 1)
        if cow and cow > sum(p not in self.compaction_sources for p in self.free_pages):
            return None
        self.compaction_sources.update(src)
        dst = [self._private(p) for p in src[:budget]]
        recent = self._private(src[-1])
        for page in src[budget:-1]:
            self._unref(page)
        request.page_ids = dst + [recent]
        request.page_hashes = []
        return src, dst

    def register_full_pages(self, request):
        """Publish the request's newly completed pages (all tokens known and computed) in the prefix cache."""
        if not self.enable_prefix_caching or request.compressed \
                or (len(request.page_hashes) + 1) * self.page_size > request.num_computed_tokens:
            return  # no page completed since the last one published (most tokens)
        known = request.num_tokens - request.num_pending
        full = min(request.num_computed_tokens, known, len(request.page_ids) * self.page_size) // self.page_size
        for i in range(len(request.page_hashes), full):
            parent = request.page_hashes[-1] if request.page_hashes else 0
            h = chain_hash(parent, request.token_slice(i * self.page_size, (i + 1) * self.page_size))
            request.page_hashes.append(h)
            page = request.page_ids[i]
            if h not in self.hash_to_page and self.page_hash[page] is None:
                self.hash_to_page[h] = page
                self.page_hash[page] = h

    # -- invariants (tests) ------------------------------------------------------------------------------
    def check_invariants(self, requests):
        owners = collections.Counter(p for r in requests for p in r.page_ids)
        assert NULL_PAGE not in owners, "null page handed out"
        assert self.ref_count[NULL_PAGE] == 0
        for page in range(1, self.num_pages):
            assert self.ref_count[page] == owners.get(page, 0), f"page {page}: ref {self.ref_count[page]} " \
                                                                f"!= owners {owners.get(page, 0)}"
            assert (self.ref_count[page] == 0) == (page in self.free_pages), f"page {page} free-list mismatch"
        for h, page in self.hash_to_page.items():
            assert self.page_hash[page] == h
