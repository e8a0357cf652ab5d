"""The worker's host inputs (``worker.input_batch``) against hand-built scheduler outputs: every array written out
by hand from the requests' pages, lengths and rows (page size 4, window 2), no device involved."""

import numpy as np
import pytest

from zipage_jax.core.request import PENDING, Request
from zipage_jax.core.scheduler_output import Compression, PrefillChunk
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker import input_batch
from zipage_jax.worker.input_batch import BatchLayout

LAYOUT = BatchLayout(page_size=4, pages_per_seq=5, sink_row=8, query_sink=3, window=2, vocab_size=50,
                     eos_token_ids=(2,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def request(rid, prompt, pages, computed, token_row=None, query_row=None, outputs=(), evicted=0, params=GREEDY):
    r = Request(rid, prompt, params, arrival=0)
    r.page_ids, r.num_computed_tokens, r.num_evicted = list(pages), computed, evicted
    r.token_row, r.query_row = token_row, query_row
    r.output_token_ids = list(outputs)
    r.output_logprobs = [0.0] * sum(t != PENDING for t in outputs)
    return r


def test_page_table_lists_each_requests_pages_and_zeros_after():
    rs = [request("a", [1], [7, 3], 1), request("b", [1], [], 0), request("c", [1], [9, 4, 6], 1)]
    np.testing.assert_array_equal(input_batch.page_table(rs, 4, 5), [[7, 3, 0, 0, 0], [0] * 5, [9, 4, 6, 0, 0],
                                                                     [0] * 5])


def test_decode_inputs_address_the_new_tokens_slot_and_feed_pending_tokens_from_the_device():
    # a: 6 tokens computed, its 6th (index 5) is a known output token; physical == logical
    a = request("a", [11, 12, 13, 14, 15], [7, 3], 6, token_row=4, query_row=1, outputs=[21, PENDING])
    # b: compressed (4 evicted): logical index 9, physical slot 5 on its second page; its input is still pending
    b = request("b", [30, 31, 32], [5, 6], 10, token_row=0, outputs=[40, 41, 42, 43, 44, 45, PENDING, PENDING],
                evicted=4)
    inputs = input_batch.decode_inputs([a, b], 4, LAYOUT)
    batch = inputs["batch"]
    np.testing.assert_array_equal(batch.tokens, [21, 0, 0, 0])  # b's token comes from the token buffer
    np.testing.assert_array_equal(batch.positions, [5, 9, 0, 0])
    np.testing.assert_array_equal(batch.slot_mapping, [3 * 4 + 1, 6 * 4 + 1, 0, 0])
    np.testing.assert_array_equal(batch.kv_lens, [6, 6, 0, 0])
    np.testing.assert_array_equal(batch.page_tables[:2], [[7, 3, 0, 0, 0], [5, 6, 0, 0, 0]])
    np.testing.assert_array_equal(batch.logits_indices, [0, 1, 2, 3])
    np.testing.assert_array_equal(inputs["from_buffer"], [False, True, False, False])
    np.testing.assert_array_equal(inputs["buffer_row"], [8, 0, 8, 8])  # the sink, but for b's own row
    np.testing.assert_array_equal(inputs["sample_row"], [4, 0, 8, 8])
    np.testing.assert_array_equal(inputs["query_row"], [1, 3, 3, 3])  # b holds no query row: the sink
    sampling = inputs["sampling"]
    assert not sampling.sampled and sampling.temperature.shape == (4,)
    assert input_batch.decode_inputs([a, b], 4, LAYOUT, force_sampled=True)["sampling"].sampled

    b.output_token_ids[6] = 46  # read back since: a replay feeds it from the host
    b.output_logprobs.append(0.0)
    replay = input_batch.known_tokens(inputs, [a, b])
    np.testing.assert_array_equal(replay["batch"].tokens, [21, 46, 0, 0])
    assert not replay["from_buffer"].any()
    np.testing.assert_array_equal(replay["batch"].slot_mapping, batch.slot_mapping)


def test_prefill_inputs_pack_chunks_and_write_the_window_queries_of_their_last_tokens():
    # a: a middle chunk of its prompt (tokens 2..6 of 9): samples nothing; holds query row 2
    a = request("a", list(range(100, 109)), [7, 3, 9], 7, token_row=5, query_row=2)
    # b: its last 3 prompt tokens: samples its first output token; no query row
    b = request("b", [60, 61, 62, 63, 64], [4, 8], 5, token_row=1)
    chunks = [PrefillChunk(a, 2, 5), PrefillChunk(b, 2, 3)]
    inputs, sampled = input_batch.prefill_inputs(chunks, 16, 3, LAYOUT)
    batch = inputs["batch"]
    assert sampled == [None, b]
    np.testing.assert_array_equal(batch.tokens[:8], [102, 103, 104, 105, 106, 62, 63, 64])
    assert not batch.tokens[8:].any()
    np.testing.assert_array_equal(batch.positions[:8], [2, 3, 4, 5, 6, 2, 3, 4])
    # a's tokens 2, 3 on page 7, 4..6 on page 3; b's 2, 3 on page 4, 4 on page 8
    np.testing.assert_array_equal(batch.slot_mapping[:8], [30, 31, 12, 13, 14, 18, 19, 32])
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 5, 8, 8])
    np.testing.assert_array_equal(batch.kv_lens, [7, 5, 0])
    np.testing.assert_array_equal(batch.logits_indices, [4, 7, 0])
    np.testing.assert_array_equal(batch.page_tables, [[7, 3, 9, 0, 0], [4, 8, 0, 0, 0], [0] * 5])
    np.testing.assert_array_equal(inputs["sample_row"], [8, 1, 8])  # only b samples
    np.testing.assert_array_equal(inputs["query_row"][:8], [3, 3, 3, 2, 2, 3, 3, 3])  # a's last W = 2 tokens
    assert not inputs["from_buffer"].any() and (inputs["buffer_row"] == 8).all()
    assert inputs["sampling"].sampled  # a prefill always runs the sampling path


def test_prefill_refuses_a_token_still_on_the_device():
    r = request("r", [1, 2, 3], [4], 3, token_row=0, outputs=[PENDING])
    with pytest.raises(AssertionError, match="still on the device"):
        input_batch.prefill_inputs([PrefillChunk(r, 1, 3)], 8, 2, LAYOUT)


def test_prompt_logprob_rows_pair_each_hidden_row_with_the_prompt_token_it_predicts():
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    a = request("a", [10, 11, 12, 13, 14, 15], [1, 2], 6, params=asking)
    b = request("b", [20, 21, 22], [3], 3)  # does not ask
    c = request("c", [30, 31, 32], [4], 3, params=asking)
    # a's chunk covers positions 2..5: rows 0..3 predict tokens 3..5 (its last token predicts no prompt token)
    chunks = [PrefillChunk(a, 2, 4), PrefillChunk(b, 0, 3), PrefillChunk(c, 0, 3)]
    parts = input_batch.prompt_logprob_rows(chunks, 3)
    assert [p.positions for p in parts] == [[3, 4, 5], [1, 2]]
    assert [[r.request_id for r in p.requests] for p in parts] == [["a", "a", "a"], ["c", "c"]]
    np.testing.assert_array_equal(parts[0].index, [[0, 1, 2], [13, 14, 15]])
    np.testing.assert_array_equal(parts[1].index, [[7, 8, 0], [31, 32, 0]])  # c's rows follow b's; one pad
    assert input_batch.prompt_logprob_rows(chunks[1:2], 3) == []


def test_compression_batch_pads_rows_and_refuses_overlapping_targets():
    a = request("a", [1], [5, 6, 7], 12, query_row=1)
    b = request("b", [1], [8, 9], 8, query_row=0, evicted=4)
    compressions = [Compression(a, [5, 6, 7], [10, 11], 12, False), Compression(b, [8, 9, 12], [8, 9], 16, True)]
    batch = input_batch.compression_batch(compressions, 2, 4, 4)
    np.testing.assert_array_equal(batch.src_tables, [[5, 6, 7, 0], [8, 9, 12, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(batch.dst_tables, [[10, 11], [8, 9], [0, 0], [0, 0]])
    np.testing.assert_array_equal(batch.num_src_pages, [3, 3, 0, 0])
    np.testing.assert_array_equal(batch.query_rows, [1, 0, 0, 0])
    np.testing.assert_array_equal(batch.logical_lens, [12, 16, 0, 0])
    np.testing.assert_array_equal(batch.compressed_before, [False, True, False, False])
    np.testing.assert_array_equal(batch.valid, [True, True, False, False])
    clash = [compressions[0], Compression(b, [8, 9, 12], [11, 13], 16, True)]
    with pytest.raises(AssertionError, match="overlapping dst pages"):
        input_batch.compression_batch(clash, 2, 2, 4)


def test_swaps_pad_to_their_bucket_with_the_null_page():
    np.testing.assert_array_equal(input_batch.padded_pages([7, 3, 9], 4), [7, 3, 9, 0])
    k = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    queries = np.ones((2, 5), np.float32)
    pk, pv, scores, q = input_batch.padded_swap((k, k + 1, np.float32(0), queries), 4)
    assert pk.shape == (2, 4, 2) and not pk[:, 3:].any() and (pk[:, :3] == k).all() and (pv[:, :3] == k + 1).all()
    assert scores.ndim == 0 and q is queries
