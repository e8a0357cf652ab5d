"""Property tests of the host page pool against a simple model of the prefix cache.

The model keeps, per published page, the exact token prefix it was published under, and drops it when the
page is handed out again. Every operation is followed by the pool's own invariant check.
"""

import pytest
from hypothesis import given, settings, strategies as st

from zipage_jax.core.page_manager import NULL_PAGE, PageManager
from zipage_jax.core.request import Request
from zipage_jax.sampling_params import SamplingParams

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=64)


class PrefixModel:
    """Independent bookkeeping: which exact token prefix each page serves, and the hit counters."""

    def __init__(self):
        self.published: dict[tuple, int] = {}  # full-page token prefix -> page
        self.considered: dict[str, int] = {}  # request id -> leading pages already offered for publishing
        self.queries = 0
        self.hits = 0

    def expected_hits(self, tokens) -> list[int]:
        pages = []
        for i in range((len(tokens) - 1) // PAGE):
            page = self.published.get(tuple(tokens[:(i + 1) * PAGE]))
            if page is None:
                break
            pages.append(page)
        return pages

    def reuse(self, page: int):
        self.published = {k: p for k, p in self.published.items() if p != page}

    def publish(self, request):
        full = min(request.num_computed_tokens, request.num_tokens) // PAGE
        for i in range(self.considered[request.request_id], full):
            prefix = tuple(request.all_token_ids[:(i + 1) * PAGE])
            page = request.page_ids[i]
            if prefix not in self.published and page not in self.published.values():
                self.published[prefix] = page
        self.considered[request.request_id] = max(full, self.considered[request.request_id])


prefixes = st.lists(st.integers(0, 2), min_size=0, max_size=12)
operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), prefixes),  # (op, shared prefix id, own suffix)
    st.tuples(st.just("advance"), st.integers(0, 50), st.integers(1, 9)),  # (op, which live request, tokens)
    st.tuples(st.just("free"), st.integers(0, 50), st.just(None)),
    st.tuples(st.just("readmit"), st.integers(0, 50), st.just(None)),  # preemption: free, then match again
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(4, 14), shared=st.lists(prefixes, min_size=4, max_size=4),
       ops=st.lists(operation, min_size=1, max_size=60), sampled=st.lists(st.integers(0, 2), min_size=64,
                                                                          max_size=64))
def test_random_operations_keep_pool_consistent(num_pages, shared, ops, sampled):
    bm = PageManager(num_pages, PAGE)
    model = PrefixModel()
    live: list[Request] = []
    next_id = 0

    def match(request):
        want = model.expected_hits(request.all_token_ids)
        got = bm.match_prefix(request)
        assert got == len(want) * PAGE and request.page_ids == want
        assert request.num_computed_tokens == got
        model.considered[request.request_id] = len(want)
        model.queries += len(request.prompt_token_ids)
        model.hits += min(got, len(request.prompt_token_ids))

    for op, a, b in ops:
        if op == "add":
            prompt = shared[a] + b
            if not prompt:
                continue
            request = Request(f"r{next_id}", prompt, PARAMS, next_id)
            next_id += 1
            match(request)
            live.append(request)
        elif not live:
            continue
        elif op == "advance":
            request = live[a % len(live)]
            if request.num_computed_tokens == request.num_tokens:  # everything computed: "sample" a token
                request.add_pending()
                request.resolve_pending(sampled[len(request.output_logprobs) % len(sampled)], 0.0)
            n = min(b, request.num_tokens - request.num_computed_tokens)
            before = list(request.page_ids)
            free_before = bm.num_free_pages
            if bm.allocate(request, n):
                new = request.page_ids[len(before):]
                assert request.page_ids[:len(before)] == before
                assert len(new) == free_before - bm.num_free_pages
                for page in new:
                    model.reuse(page)
                # the pages this chunk writes are private and not in the cache: shared pages are never written
                for i in range(request.num_computed_tokens, request.num_computed_tokens + n):
                    page = request.page_ids[i // PAGE]
                    assert page != NULL_PAGE and bm.ref_count[page] == 1 and bm.page_hash[page] is None
                request.num_computed_tokens += n
                bm.register_full_pages(request)
                model.publish(request)
            else:
                assert request.page_ids == before and bm.num_free_pages == free_before
                assert bm.pages_needed(request, n) > free_before
        elif op == "free":
            request = live.pop(a % len(live))
            bm.free(request)
            assert request.page_ids == []
        elif op == "readmit":
            request = live[a % len(live)]
            bm.free(request)
            request.num_computed_tokens = 0
            match(request)
        bm.check_invariants(live)
        assert bm.num_free_pages == num_pages - 1 - len({p for r in live for p in r.page_ids})
        assert (bm.prefix_queries, bm.prefix_hits) == (model.queries, model.hits)

    for request in live:
        bm.free(request)
    bm.check_invariants([])
    assert bm.num_free_pages == num_pages - 1 and bm.num_used_pages == 0


def computed(bm, request_id, tokens, arrival) -> Request:
    """A request whose prompt was matched, allocated, computed and published in ``bm``."""
    request = Request(request_id, tokens, PARAMS, arrival)
    bm.match_prefix(request)
    assert bm.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.register_full_pages(request)
    return request


def test_shared_prefix_is_found_by_a_later_request_and_survives_its_owner():
    bm = PageManager(16, PAGE)
    first = computed(bm, "a", list(range(10)), 0)
    second = Request("b", list(range(9)) + [99], PARAMS, 1)
    assert bm.match_prefix(second) == 8 and second.page_ids == first.page_ids[:2]
    assert [bm.ref_count[p] for p in first.page_ids] == [2, 2, 1]
    bm.free(first)
    bm.free(second)
    third = Request("c", list(range(8)) + [7], PARAMS, 2)  # a freed, still-hashed page is a hit
    assert bm.match_prefix(third) == 8
    bm.check_invariants([third])
    assert bm.hit_rate() == pytest.approx(16 / 29)


def test_last_known_token_is_never_served_from_the_cache():
    bm = PageManager(8, PAGE)
    computed(bm, "a", list(range(8)), 0)
    again = Request("b", list(range(8)), PARAMS, 1)
    assert bm.match_prefix(again) == 4  # the page holding token 7 must be recomputed for its logits


def test_num_pages_below_two_raises():
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(1, PAGE)


def test_copy_on_write_target_is_never_read_by_another_compression_of_the_step():
    """The compaction kernel runs a batch's requests concurrently and in place, so a page released by one
    compression must not become another's copy-on-write target in the same step; next step it may."""
    bm = PageManager(8, PAGE, enable_prefix_caching=True)
    owner = computed(bm, "owner", list(range(4)) + [50, 51, 52, 53], 0)
    sharer = Request("sharer", list(range(4)) + [60, 61, 62, 63, 64, 65, 66, 67], PARAMS, 1)
    assert bm.match_prefix(sharer) == 4  # its first page is the owner's
    assert bm.allocate(sharer, 8)
    other = Request("other", list(range(100, 112)), PARAMS, 2)
    bm.match_prefix(other)
    assert bm.allocate(other, 12)
    assert bm.num_free_pages == 0
    src, dst = bm.allocate_compaction(other, budget=1)  # releases its middle page, straight to the free list
    released = src[1]
    assert dst == src[:1] and bm.num_free_pages == 1 and released in bm.free_pages
    assert bm.allocate_compaction(sharer, budget=1) is None  # the only free page is still read this step
    bm.check_invariants([owner, sharer, other])
    bm.new_step()
    shared_page = sharer.page_ids[0]
    src, dst = bm.allocate_compaction(sharer, budget=1)
    assert src[0] == shared_page and dst == [released] and bm.ref_count[shared_page] == 1
    bm.check_invariants([owner, sharer, other])
