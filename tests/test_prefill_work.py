"""`bench prefill-work`: the ragged prefill's work counted from the kernel's tiling, on cases small enough to count
by hand."""

import numpy as np

from zipage_jax.benchmarks import prefill_work as model


def test_items_blocks_and_keys_of_a_short_and_a_long_prompt():
    # 40 tokens in tiles of 32: [32, 40) first (last-first), then [0, 32); both within one KV block of 128
    blocks, masked, computed, causal = model.items_of([40], tile_tokens=32, block_kv=128, num_slabs=1)
    assert blocks.tolist() == [1, 1] and masked == 2
    assert computed == 128 * 8 + 128 * 32 and causal == 40 * 41 // 2
    # 256 tokens, two slabs: tiles 7..0 reach 256, 224, ..., 32 keys: blocks 2,2,2,2,1,1,1,1, each twice
    blocks, masked, computed, causal = model.items_of([256], tile_tokens=32, block_kv=128, num_slabs=2)
    assert blocks.tolist() == [n for n in (2, 2, 2, 2, 1, 1, 1, 1) for _ in range(2)]
    assert masked == 2 * 8  # tiles from 128 on run block 0 unmasked (wholly below them), block 1 masked
    assert causal == 2 * 256 * 257 // 2 and computed == 2 * 32 * 128 * (4 * 2 + 4 * 1)
    # half-width last block: tiles ending at positions 31, 63 (and 159, 191) need keys below 64 of their last block
    computed_half = model.items_of([256], tile_tokens=32, block_kv=128, num_slabs=2, half_diagonal=True)[2]
    assert computed_half == computed - 2 * 4 * 32 * 64


def test_round_robin_snake_and_longest_first_loads():
    costs = np.array([4, 1, 1, 1, 1, 4])
    # round-robin over 2 CTAs: [4, 1, 1] and [1, 1, 4] are even; over 3: [4, 1], [1, 1], [1, 4]
    assert model.busiest_over_mean(costs, 2, "round-robin") == 1.0
    assert model.busiest_over_mean(costs, 3, "round-robin") == 5 / 4
    # snake over 3: 4 1 1 | 1 1 4 dealt to CTAs 0 1 2 | 2 1 0
    assert model.cta_loads(costs, 3, "snake").tolist() == [8, 2, 2]
    # longest-first to the least loaded of 3: 4 | 4 | 1+1+1+1 balances exactly
    assert model.cta_loads(costs, 3, "longest-first").tolist() == [4, 4, 4]
    # two requests' tiles, each last-first: round-robin gives CTA 0 both largest, the snake pairs large with small
    sawtooth = np.array([3, 2, 1, 3, 2, 1])
    assert model.cta_loads(sawtooth, 3, "round-robin").tolist() == [6, 4, 2]
    assert model.cta_loads(sawtooth, 3, "snake").tolist() == [4, 4, 4]


def test_command_line_prints_a_row_per_case(capsys):
    [row] = model.main(["--cases", "2x128"])
    assert row["case"] == "2x128" and row["items"] == 2 * 4 * 8  # 4 tiles of 32 a prompt, 8 slabs of 4 query heads
    assert row["computed_over_causal"] >= row["half_diagonal_over_causal"] >= 1
    assert set(row["busiest_over_mean"]) == set(model.ORDERS)
    assert "2x128" in capsys.readouterr().out
