"""Which tokens each (layer, KV head) still holds when a compressed request generates a token.

The accuracy lab's question when compression costs accuracy: which tokens did the failing runs evict that the
passing ones kept? The engine stores no positions (a compacted slot is just a key and a value), so the trace
recovers them from the keys: it observes each compression dispatch (``LLMEngine.add_compression_observer``), reads
the keys of the source pages before a compression (the tokens kept last time, in cache order, then the tokens
computed since) and of the destination pages after it, and matches the kept keys back to positions in order (compaction is stable, so
the kept keys are a subsequence of the cached ones). A key is a function of its token, its position (RoPE)
and its context, so equal keys at two positions of one (layer, head) would be a coincidence of float bits; a
match that fails raises rather than guess.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Snapshot:
    """The cache of one request right after one compression: ``positions[layer][head]``, sorted."""

    logical_len: int
    positions: list[list[np.ndarray]]


class EvictionTrace:
    """Observes ``llm``'s compression dispatches; ``snapshots[request_id]`` grows by one per compression."""

    def __init__(self, llm):
        self.snapshots: dict[str, list[Snapshot]] = {}
        model_cfg = llm.engine.model_cfg
        self._layers_and_heads = (model_cfg.num_layers, model_cfg.num_kv_heads)
        llm.engine.add_compression_observer(self._trace)

    def _trace(self, dispatch, run):
        """Read each request's source pages before the dispatch and its destination pages after it."""
        k_pool = dispatch.state().k_pool
        before = [np.asarray(k_pool[:, np.asarray(c.src_pages)]) for c in dispatch.compressions]
        run()
        k_pool = dispatch.state().k_pool
        for c, keys in zip(dispatch.compressions, before):
            after = np.asarray(k_pool[:, np.asarray(c.dst_pages)])
            self._record(c.request.request_id, c.logical_len, _by_head(keys), _by_head(after))

    def _record(self, request_id: str, logical_len: int, cached: np.ndarray, kept: np.ndarray):
        history = self.snapshots.setdefault(request_id, [])
        layers, heads, n = cached.shape[:3]
        if history:  # the tokens kept last time, then every token computed since
            last = history[-1]
            positions = [[np.concatenate([last.positions[l][h], np.arange(last.logical_len, logical_len)])
                          for h in range(heads)] for l in range(layers)]
        else:  # nothing evicted yet: slot i holds position i
            positions = [[np.arange(logical_len) for _ in range(heads)] for _ in range(layers)]
        live = len(positions[0][0])  # the last source page may be part-filled
        if live > n:
            raise RuntimeError(f"request {request_id}: {n} cached slots for {live} tokens")
        held = [[_subsequence(cached[l, h, :live], kept[l, h], positions[l][h]) for h in range(heads)]
                for l in range(layers)]
        history.append(Snapshot(logical_len, held))

    def held(self, request_id: str, position: int, at: int) -> np.ndarray:
        """[layers, heads] bool: whether each (layer, head) holds ``position`` when the token at logical position
        ``at`` is computed (after the last compression of a length ≤ ``at``; all tokens before the first)."""
        history = [s for s in self.snapshots.get(request_id, []) if s.logical_len <= at]
        if not history or position >= history[-1].logical_len:  # computed since: not yet evicted
            return np.full(self._shape(request_id), position < at)
        return np.array([[position in held for held in row] for row in history[-1].positions])

    def _shape(self, request_id: str) -> tuple[int, int]:
        history = self.snapshots.get(request_id)
        if history:
            return len(history[0].positions), len(history[0].positions[0])
        return self._layers_and_heads


def _by_head(pages: np.ndarray) -> np.ndarray:
    """k_pool pages [L, P, Hkv, S, D] -> [L, Hkv, P*S, D] in slot order."""
    layers, n_pages, heads, size, dim = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(layers, heads, n_pages * size, dim)


def _subsequence(cached: np.ndarray, kept: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Positions of ``kept`` keys, matched in order against ``cached`` keys (bit-exact)."""
    cached_bits = cached.view(np.uint8).reshape(len(cached), -1)
    out, i = [], 0
    for key in kept.view(np.uint8).reshape(len(kept), -1):
        while i < len(cached_bits) and not np.array_equal(cached_bits[i], key):
            i += 1
        if i == len(cached_bits):
            raise RuntimeError("a kept key matches no cached key after the previous match")
        out.append(positions[i])
        i += 1
    return np.asarray(out)
