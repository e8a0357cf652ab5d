"""Where the ragged prefill case loses against one long prompt, from the kernel's tiling alone (no GPU):
`python -m zipage_jax.bench prefill-work`.

    python -m zipage_jax.bench prefill-work [--cases 1x8192 64x128-2048] [--ctas 132]

For each `pallas_kernels.bench` prefill case (the same lengths) and Qwen3-8B's heads (32 q / 8 kv: items of
32 tokens x 4 query heads, per `ragged_prefill.gqa_tiling`), it counts what `ragged_prefill` runs: the work items,
their KV blocks (`block_kv` 128), the share of blocks that are diagonal (masked), the keys computed against the
causal ones (every block at full width, and with `ragged_prefill`'s half-width last block), and the load of the
busiest persistent CTA against the mean for each order of `cta_loads`. Costs count KV blocks only, so per-item
overheads (query loads, stores, pipeline fill) come on top of what it shows.
"""

import argparse
import heapq

import numpy as np

from pallas_kernels.bench import PREFILL_CASES, prefill_lengths
from pallas_kernels.ragged_prefill import gqa_tiling


def items_of(lengths, tile_tokens, block_kv, num_slabs, half_diagonal=False):
    """KV blocks of every item in the order tiles are cut (a request's tiles last-first, its slabs side by side),
    how many of them run masked (not wholly below the tile's first position, as ``ragged_prefill.tile_span``), and
    the keys computed and causally needed; ``half_diagonal``: the last block computes its first half only when
    the tile's last position needs no more (``ragged_prefill(half_diagonal=True)``, block_kv 128)."""
    blocks, masked, computed, causal = [], 0, 0, 0
    for length in lengths:
        for tile in reversed(range(-(-int(length) // tile_tokens))):
            lo, hi = tile * tile_tokens, min((tile + 1) * tile_tokens, int(length))
            num_blocks = -(-hi // block_kv)
            keys = num_blocks * block_kv
            if half_diagonal and (hi - 1) % block_kv < block_kv // 2:
                keys -= block_kv // 2
            blocks += [num_blocks] * num_slabs
            masked += num_slabs * (num_blocks - (lo + 1) // block_kv)
            computed += num_slabs * keys * (hi - lo)
            causal += num_slabs * ((hi * (hi + 1) - lo * (lo + 1)) // 2)
    return np.array(blocks), masked, computed, causal


ORDERS = ("round-robin", "snake", "longest-first")


def cta_loads(costs, num_ctas, order):
    """Each persistent CTA's summed cost of the items (``costs`` in the kernel's tile order) dealt ``round-robin``
    (``cta, cta + num_ctas, ...``: ``ragged_prefill(item_order="round_robin")``), ``snake`` (round ``k`` to CTAs
    0, 1, ... when even and ..., 1, 0 when odd: the kernel's default), or ``longest-first`` to the least loaded
    CTA (greedy, near ideal, needs a running queue the kernel has not)."""
    costs = np.asarray(costs)
    if order == "longest-first":
        heap = [(0, c) for c in range(num_ctas)]
        for cost in sorted(costs, reverse=True):
            load, cta = heapq.heappop(heap)
            heapq.heappush(heap, (load + cost, cta))
        return np.array([load for _, load in sorted((cta, load) for load, cta in heap)])
    rounds, place = np.divmod(np.arange(len(costs)), num_ctas)
    if order == "snake":
        place = np.where(rounds % 2, num_ctas - 1 - place, place)
    return np.bincount(place, weights=costs, minlength=num_ctas)


def busiest_over_mean(costs, num_ctas, order):
    loads = cta_loads(costs, num_ctas, order)
    return loads.max() / loads.mean()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench prefill-work", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=PREFILL_CASES)
    parser.add_argument("--ctas", type=int, default=132, help="persistent CTAs (an H100 or H200 has 132 SMs)")
    parser.add_argument("--block-kv", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    rows = []
    heads, tile_tokens = gqa_tiling(args.q_heads // args.kv_heads)
    num_slabs = args.q_heads // heads
    print(f"items of {tile_tokens} tokens x {heads} query heads, KV blocks of {args.block_kv}, {args.ctas} CTAs")
    print("keys computed / causal, full width and with the half-width diagonal; the busiest CTA / mean per order")
    print(f"{'case':>14} {'items':>7} {'blocks/item':>11} {'diagonal':>8} {'computed/causal':>15} "
          f"{'half diagonal':>13} " + " ".join(f"{order:>13}" for order in ORDERS))
    for case in args.cases:
        lengths = prefill_lengths(case)
        blocks, masked, computed, causal = items_of(lengths, tile_tokens, args.block_kv, num_slabs)
        computed_half = items_of(lengths, tile_tokens, args.block_kv, num_slabs, half_diagonal=True)[2]
        balance = {order: float(busiest_over_mean(blocks, args.ctas, order)) for order in ORDERS}
        rows.append(dict(case=case, items=len(blocks), blocks_per_item=float(blocks.mean()),
                         diagonal=masked / blocks.sum(), computed_over_causal=computed / causal,
                         half_diagonal_over_causal=computed_half / causal, busiest_over_mean=balance))
        print(f"{case:>14} {len(blocks):>7} {blocks.mean():>11.1f} {masked / blocks.sum():>8.1%} "
              f"{computed / causal:>15.3f} {computed_half / causal:>13.3f} "
              + " ".join(f"{balance[order]:>13.3f}" for order in ORDERS))
    return rows
