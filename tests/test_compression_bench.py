"""CPU smoke test of the compression benchmark (tiny shapes, kernels interpreted): every row is measured without
error and the kernels agree with the jnp path; and of the kernel benchmark's command line."""

import json

import pytest

from pallas_kernels import bench as kernel_bench
from zipage_jax.benchmarks import compression as bench


def test_compression_section_runs_on_cpu(tmp_path):
    out = tmp_path / "compression.json"
    # the kernels interpret per row: one is enough here; and the smallest page (the kernel tests run every page size
    # against the oracle): this smoke test checks that every row runs and the kernels agree with the jnp path
    bench.main(["--comp-model-shape", "tiny", "--comp-batch", "1", "--comp-budget", "2", "--comp-page", "16",
                "--comp-reps", "1", "--interpret", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r for r in rows), [r["error"] for r in rows if "error" in r]
    parts = {(r["part"], r["impl"]) for r in rows}
    # interpreted, the kernels' tuning variants are left to the GPU (the kernel tests check every option)
    assert parts == {("scoring_one_layer", "kernel"), ("scoring_one_layer", "jnp"),
                     ("redundancy_one_layer", "kernel"), ("redundancy_one_layer", "jnp"),
                     ("selection_one_layer", "sorted_threshold"), ("selection_one_layer", "kernel_threshold"),
                     ("compaction_one_layer", "mosaic_in_place"), ("compaction_one_layer", "xla_slot_gather_scatter"),
                     ("compaction_one_layer", "xla_page_scatter"),
                     ("compress_step", "kernel"), ("compress_step", "jnp"), ("decode_step", "forward_paged")}
    scoring = [r for r in rows if r["part"] == "scoring_one_layer"]
    assert all(r["ok"] and r["rel_err"] <= bench.MAX_REL_ERR and r["scratch_bytes"] > 0 for r in scoring)
    assert all(r["rel_err_ragged"] <= bench.MAX_REL_ERR for r in scoring if r["impl"] != "jnp")
    redundancy = [r for r in rows if r["part"] == "redundancy_one_layer"]
    assert all(r["ok"] and r["rel_err"] <= bench.MAX_REL_ERR for r in redundancy)
    assert all(r["exact"] for r in rows if r["part"] == "selection_one_layer")
    decode = next(r for r in rows if r["part"] == "decode_step")
    assert {"ratio_kernel", "ratio_jnp"} <= set(decode)
    assert all(r["ms"] > 0 for r in rows)


def test_unknown_section_raises():
    for section in ("nope", "compression"):  # compression lives in zipage_jax.benchmarks.compression
        with pytest.raises(ValueError, match="sections"):
            kernel_bench.main(["--sections", section])
