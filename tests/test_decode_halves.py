"""scripts/decode_variants.py's ``forward_halves``: a decode step in two interleaved half-batches (the overlap
experiment for large batches) computes what ``forward_paged`` does, its stream variant annotates each attention
for a second GPU stream, and a variant XLA cannot compile is a row of its own."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.layers.attention import REFERENCE
from zipage_jax.models import PagedBatch, forward_paged, to_serving, weights
from helpers import load_script
from seeds import seeded_rng

variants = load_script("decode_variants")


def decode_case(rng, cfg, rows=5, page=16, pages_per_row=3):
    params = to_serving(weights.init_random_params(cfg, jax.random.key(int(rng.integers(1 << 30))), jnp.float32))
    shape = (cfg.num_layers, rows * pages_per_row + 1, cfg.num_kv_heads, page, cfg.head_dim)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    tables = 1 + rng.permutation(rows * pages_per_row).reshape(rows, pages_per_row).astype(np.int32)
    lens = rng.integers(1, page * pages_per_row, size=rows).astype(np.int32)  # the new token is the last
    slots = tables[np.arange(rows), (lens - 1) // page] * page + (lens - 1) % page
    batch = PagedBatch(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, size=rows), jnp.int32),
                       positions=jnp.asarray(lens - 1), slot_mapping=jnp.asarray(slots, jnp.int32),
                       kv_lens=jnp.asarray(lens), page_tables=jnp.asarray(tables),
                       logits_indices=jnp.arange(rows, dtype=jnp.int32))
    return params, k_pool, v_pool, batch


def test_two_interleaved_halves_compute_the_same_step():
    cfg = MODEL_SHAPES["tiny"]
    params, k_pool, v_pool, batch = decode_case(seeded_rng(), cfg)  # 5 rows: halves of 2 and 3
    want = jax.jit(lambda *a: forward_paged(params, cfg, *a, REFERENCE))(k_pool, v_pool, batch)
    got = jax.jit(lambda *a: variants.forward_halves(params, cfg, *a, REFERENCE))(k_pool, v_pool, batch)
    for name, g, w in zip(("logits", "k_pool", "v_pool"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
    assert not np.array_equal(np.asarray(want[1]), np.asarray(k_pool))  # the step wrote its K


def test_the_stream_variant_puts_every_attention_on_stream_one():
    cfg = MODEL_SHAPES["tiny"]
    params, k_pool, v_pool, batch = decode_case(seeded_rng(), cfg)
    text = jax.jit(lambda *a: variants.forward_halves(params, cfg, *a, REFERENCE, stream=True)).lower(
        k_pool, v_pool, batch).as_text()
    calls = [line for line in text.splitlines() if "call @compute_on" in line]
    assert len(calls) == 2 * cfg.num_layers and all('_xla_stream_annotation = "1"' in c for c in calls)


def test_a_variant_that_does_not_compile_is_a_row_and_the_others_still_run(monkeypatch, tmp_path):
    """On an H100 XLA rejected ``halves+stream`` (its stream annotation) and the script stopped with every other
    variant unmeasured; now the error is that variant's row."""
    monkeypatch.setitem(variants.VARIANTS, "broken", ("serving", {"xla_no_such_option": True}))
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["decode_variants", "--model-shape", "tiny", "--batch", "2", "--ctx", "16",
                                      "--page-size", "16", "--variants", "broken", "unrolled",
                                      "--attention-backend", "reference", "--json", str(out)])
    variants.main()
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert "xla_no_such_option" in rows["broken"]["error"] and "ms" not in rows["broken"]
    assert rows["unrolled"]["ms"] > 0 and "error" not in rows["unrolled"]
