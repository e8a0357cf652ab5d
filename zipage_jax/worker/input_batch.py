"""A step's host inputs, as pure functions of what the scheduler decided: page tables, sampling tensors, and the
decode, prefill, compression, prompt-logprobs and swap inputs, padded to their shape bucket. Plain numpy; the worker
packs each into one buffer (``packing``) and dispatches it. Nothing here touches a device or changes a request.
"""

import dataclasses
import itertools

import numpy as np

from zipage_jax.compression.step import CompressionBatch
from zipage_jax.core.request import PENDING
from zipage_jax.layers.sampler import SamplingRow, SamplingTensors
from zipage_jax.models import PagedBatch
from zipage_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The fixed facts a step's inputs are laid out by."""

    page_size: int
    pages_per_seq: int  # page-table width
    sink_row: int  # token-buffer row of rows that sample nothing (max_num_seqs)
    query_sink: int  # query-cache row of requests without one (num_query_rows)
    window: int  # window queries a compression scores with
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


def page_table(requests, rows: int, pages_per_seq: int) -> np.ndarray:
    """``[rows, pages_per_seq]`` page ids of ``requests`` (zeros past each one's pages), filled in one scatter."""
    table = np.zeros((rows, pages_per_seq), np.int32)
    lengths = np.fromiter((len(r.page_ids) for r in requests), np.int64, len(requests))
    total = int(lengths.sum())
    if total:
        ids = np.fromiter(itertools.chain.from_iterable(r.page_ids for r in requests), np.int32, total)
        row = np.repeat(np.arange(len(requests)), lengths)
        col = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        table[row, col] = ids
    return table


def sampling_tensors(requests, rows: int, layout: BatchLayout, force_sampled: bool = False) -> SamplingTensors:
    """Per-row sampling tensors (None rows sample greedily into the sink); ``force_sampled`` picks the sampling code
    path even for all-greedy rows (a prefill always does: one program per bucket, its cost small next to it)."""
    sampling_rows = [
        SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.seed, len(r.output_token_ids))
        if r is not None else SamplingRow(GREEDY, (), (), 0, 0)
        for r in requests
    ]
    tensors = SamplingTensors.from_rows(sampling_rows, layout.vocab_size, layout.eos_token_ids, batch_size=rows)
    return tensors.replace(sampled=True) if force_sampled else tensors


def decode_inputs(requests, rows: int, layout: BatchLayout, force_sampled: bool = False) -> dict:
    """One token per request: the one at index ``num_computed_tokens - 1`` (counted by the scheduler already). A
    token the host has not read back yet (``PENDING``) is fed from the device's token buffer."""
    n = len(requests)
    index = np.fromiter((r.num_computed_tokens for r in requests), np.int32, n) - 1  # logical position
    physical = np.fromiter((r.num_physical_tokens for r in requests), np.int32, n) - 1  # its slot's index
    known = np.fromiter((r.token_at(i) for r, i in zip(requests, index.tolist())), np.int32, n)
    token_row = np.fromiter((r.token_row for r in requests), np.int32, n)
    query = np.fromiter((layout.query_sink if r.query_row is None else r.query_row for r in requests), np.int32, n)
    table = page_table(requests, rows, layout.pages_per_seq)
    pending = known == PENDING

    def padded(values, fill=0, dtype=np.int32):
        out = np.full(rows, fill, dtype)
        out[:n] = values
        return out

    size = layout.page_size
    page_of_slot = table[np.arange(n), physical // size]
    batch = PagedBatch(tokens=padded(np.where(pending, 0, known)), positions=padded(index),
                       slot_mapping=padded(page_of_slot * size + physical % size), kv_lens=padded(physical + 1),
                       page_tables=table, logits_indices=np.arange(rows, dtype=np.int32))
    return dict(batch=batch, sampling=sampling_tensors(requests, rows, layout, force_sampled),
                from_buffer=padded(pending, False, bool),
                buffer_row=padded(np.where(pending, token_row, layout.sink_row), layout.sink_row),
                sample_row=padded(token_row, layout.sink_row), query_row=padded(query, layout.query_sink))


def known_tokens(inputs: dict, requests) -> dict:
    """``decode_inputs`` again with every token fed from the host: those it read from the device then are known
    now (a replay of the step, for benchmarks)."""
    batch = inputs["batch"]
    tokens = np.array(batch.tokens)
    for row in np.flatnonzero(inputs["from_buffer"]):
        tokens[row] = requests[row].token_at(int(batch.positions[row]))
    return dict(inputs, batch=batch.replace(tokens=tokens), from_buffer=np.zeros_like(inputs["from_buffer"]))


def prefill_inputs(chunks, num_tokens: int, rows: int, layout: BatchLayout) -> tuple[dict, list]:
    """Packed prompt chunks padded to ``num_tokens`` tokens and ``rows`` rows; also, per row, the request whose
    next token it samples (None: its chunk ends before the last known token)."""
    total = sum(c.num_tokens for c in chunks)
    tokens, positions, slots = (np.zeros(num_tokens, np.int32) for _ in range(3))
    cu_q_lens = np.full(rows + 1, total, np.int32)
    kv_lens, last_token = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    sample_row = np.full(rows, layout.sink_row, np.int32)
    query_row = np.full(num_tokens, layout.query_sink, np.int32)
    offset, sampled, size = 0, [], layout.page_size
    for i, c in enumerate(chunks):
        r, n = c.request, c.num_tokens
        ids = r.token_slice(c.start, c.start + n)
        assert PENDING not in ids, "prefill over a token still on the device"
        tokens[offset:offset + n] = ids
        index = np.arange(c.start, c.start + n)
        positions[offset:offset + n] = index
        pages = np.asarray(r.page_ids, np.int32)[index // size]
        slots[offset:offset + n] = pages * size + index % size
        cu_q_lens[i] = offset
        if r.query_row is not None:  # one writer per ring slot: the chunk's last W tokens
            query_row[max(offset, offset + n - layout.window):offset + n] = r.query_row
        offset += n
        kv_lens[i], last_token[i] = c.start + n, offset - 1
        if c.samples:
            sample_row[i] = r.token_row
        sampled.append(r if c.samples else None)
    batch = PagedBatch(tokens=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                       page_tables=page_table([c.request for c in chunks], rows, layout.pages_per_seq),
                       logits_indices=last_token, cu_q_lens=cu_q_lens)
    inputs = dict(batch=batch, sampling=sampling_tensors(sampled, rows, layout, force_sampled=True),
                  from_buffer=np.zeros(num_tokens, bool), buffer_row=np.full(num_tokens, layout.sink_row, np.int32),
                  sample_row=sample_row, query_row=query_row)
    return inputs, sampled


@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """One dispatch of the prompt-logprobs program: ``index[0]`` the rows of a prefill's hidden states,
    ``index[1]`` the prompt token each predicts (padding: row 0 against token 0, read by nobody); entry i is prompt
    token ``positions[i]`` of ``requests[i]``."""

    index: np.ndarray  # [2, size] int32
    requests: list
    positions: list[int]


def prompt_logprob_rows(chunks, size: int) -> list[PromptLogprobRows]:
    """The prompt tokens the chunks of requests asking for prompt logprobs predict, ``size`` a dispatch: the token
    at position t predicts prompt token t + 1, which the host knows (a chunk's last token predicts the next chunk's
    first); output tokens (a recompute) are not scored."""
    rows, targets, requests, positions = [], [], [], []
    offset = 0
    for c in chunks:
        r = c.request
        if r.sampling_params.prompt_logprobs is not None:
            prompt = r.prompt_token_ids
            end = min(c.start + c.num_tokens, len(prompt) - 1)
            count = max(end - c.start, 0)
            rows.extend(range(offset, offset + count))
            targets.extend(prompt[c.start + 1:end + 1])
            requests.extend([r] * count)
            positions.extend(range(c.start + 1, end + 1))
        offset += c.num_tokens
    parts = []
    for start in range(0, len(rows), size):
        index = np.zeros((2, size), np.int32)
        part = slice(start, start + size)
        index[0, :len(rows[part])] = rows[part]
        index[1, :len(targets[part])] = targets[part]
        parts.append(PromptLogprobRows(index, requests[part], positions[part]))
    return parts


def compression_batch(compressions, budget: int, rows: int, width: int) -> CompressionBatch:
    """The compressions of one dispatch (budget ``M`` = ``budget`` destination pages each) padded to ``rows`` rows
    of ``width`` source pages; padding rows are invalid and write nowhere."""
    src = np.zeros((rows, width), np.int32)
    dst = np.zeros((rows, budget), np.int32)
    num_src, query_rows, logical = (np.zeros(rows, np.int32) for _ in range(3))
    before, valid = np.zeros(rows, bool), np.zeros(rows, bool)
    for i, c in enumerate(compressions):
        assert c.request.query_row is not None, "compression without a query row"
        src[i, :len(c.src_pages)] = c.src_pages
        dst[i] = c.dst_pages
        num_src[i], query_rows[i], logical[i] = len(c.src_pages), c.request.query_row, c.logical_len
        before[i], valid[i] = c.compressed_before, True
    targets = dst[valid]  # the compaction's scatter assumes distinct real pages (unique_indices)
    assert targets.min(initial=1) > 0 and len(np.unique(targets)) == targets.size, "overlapping dst pages"
    return CompressionBatch(src_tables=src, num_src_pages=num_src, dst_tables=dst, query_rows=query_rows,
                            logical_lens=logical, compressed_before=before, valid=valid)


def padded_pages(pages, size: int) -> np.ndarray:
    """A swap's page ids padded to its bucket: padding slots address the null page."""
    out = np.zeros(size, np.int32)
    out[:len(pages)] = pages
    return out


def padded_swap(contents: tuple, size: int) -> tuple:
    """Swapped-out ``(k, v, scores, queries)`` host arrays padded along the page axis to ``size`` pages (scores and
    queries are scalar placeholders where the engine keeps no score history or window queries)."""
    k, v, scores, queries = contents

    def pad(a):
        return np.concatenate([a, np.zeros((a.shape[0], size - a.shape[1]) + a.shape[2:], a.dtype)], axis=1)

    return pad(k), pad(v), pad(scores) if scores.ndim else scores, queries
