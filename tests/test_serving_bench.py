"""`python -m zipage_jax.bench serving` against a real server (the shipped tiny model on CPU, loopback HTTP): its
latency accounting, and a short soak with client cancellations after which the server's pages return."""

import pytest

from live_server import live_server
from waiting import HANG_S
from zipage_jax import bench
from zipage_jax.benchmarks import serving
from zipage_jax.engine.llm_engine import LLMEngine

TINY_MODEL = "zipage_jax/assets/tiny-reasoner"


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine.from_kwargs(TINY_MODEL, max_num_seqs=8, page_size=16, max_model_len=256,
                                   max_num_batched_tokens=64, max_num_prefill_seqs=4, dtype="float32",
                                   num_gpu_pages_override=64, compilation_cache_dir=None, compression=True,
                                   kv_budget_pages=2)
    with live_server(engine) as live:
        yield live.url


COMMON = ["--page-size", "16", "--budget-tokens", "16", "--vocab-size", "128", "--max-model-len", "160"]


def test_rates_report_latency_percentiles_and_goodput(url, tmp_path):
    out = tmp_path / "serving.json"
    report, _ = bench.main(["serving", "--url", url, "--rates", "50", "--requests", "6", "--slo-ttft", "1e9",
                            "--slo-tpot", "1e9", "--json", str(out), *COMMON])
    (row,) = report["rates"]
    workload = report["workload"]
    assert report["model"] == "tiny-reasoner" and out.stat().st_size > 0
    assert row["requests"] == row["completed"] == 6 and row["errors"] == 0 and row["cancelled"] == 0
    # every token was streamed and counted: the usage totals are the requests' max_tokens
    assert row["output_tokens_per_s"] * row["wall_s"] == pytest.approx(workload["output_tokens_total"])
    for key in ("ttft_s", "itl_s", "e2e_s", "tpot_s"):
        d = row[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"], key
    assert row["ttft_s"]["p99"] <= row["e2e_s"]["p99"] and row["e2e_s"]["p99"] <= row["wall_s"]
    assert row["goodput"] == pytest.approx(row["request_throughput"])  # SLOs nobody misses
    strict = serving.summarize([dict(r, ttft=1.0) for r in [_result(0.5, 4)]], 1.0, 1.0, 0.1, 1.0)
    assert strict["goodput"] == 0 and strict["completed"] == 1  # a missed TTFT SLO is not goodput


def _result(e2e, tokens):
    return dict(start=0.0, ttft=0.1, e2e=e2e, itl=[0.1] * (tokens - 1), tpot=0.1, tokens=tokens, chunks=tokens,
                max_tokens=tokens, error=None, cancelled=False)


def test_soak_with_cancellations_returns_every_page(url):
    import os

    # outputs of a mean 4.5 budgets of 32 tokens (clipped to the context), most cancelled in their first half: a
    # loaded machine's client, slow to read its chunks, still closes streams the server is sending (an abort)
    report, _ = bench.main(["serving", "--url", url, "--rates", "--requests", "8", "--soak", "3", "--soak-rate",
                            "8", "--cancel-prob", "0.8", "--server-pid", str(os.getpid()), "--drain-timeout", str(HANG_S),
                            "--rss-tolerance-mb", "1e6", *COMMON, "--budget-tokens", "32"])
    soak = report["soak"]
    assert soak["summary"]["cancelled"] > 0 and soak["summary"]["errors"] == 0
    assert soak["client_aborts"] > 0  # the server saw the closed streams
    # a cancelled stream had chunks, so its request held pages; the 1 Hz samples of the peak may miss them all
    assert soak["pages_returned"] and soak["idle_after"]
    assert soak["kv_pages_used_after"] == soak["kv_pages_used_before"]
    assert soak["rss_growth_second_half_mb"] is not None and soak["memory_flat"]


def test_bad_arguments_raise(url):
    with pytest.raises(ValueError, match="rates"):
        bench.main(["serving", "--url", url, "--rates", "0", *COMMON])
    with pytest.raises(ValueError, match="cancel_prob"):
        bench.main(["serving", "--url", url, "--cancel-prob", "2", *COMMON])


def test_closed_loop_streams_and_the_offline_engine_run_the_same_requests(url, tmp_path):
    """``--concurrency N``: N streams keep every request of the workload in flight until it has run, each counted
    once; ``--offline``: the same requests through the in-process engine give the same token count (the ceiling
    the server is compared with)."""
    report, _ = bench.main(["serving", "--url", url, "--rates", "--requests", "7", "--concurrency", "3",
                            "--slo-ttft", "1e9", "--slo-tpot", "1e9", *COMMON])
    (row,) = report["concurrency"]
    total = report["workload"]["output_tokens_total"]
    assert row["concurrency"] == 3 and row["requests"] == row["completed"] == 7 and row["errors"] == 0
    assert row["output_tokens_per_s"] * row["wall_s"] == pytest.approx(total)
    assert serving.format_rate(row).startswith("concurrency 3: 7/7 done")
    offline, _ = bench.main(["serving", "--offline", "--model", TINY_MODEL, "--requests", "7", "--concurrency", "3",
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--dtype", "float32",
                             "--compilation-cache-dir", "none", *COMMON])
    (run,) = offline["concurrency"]
    assert offline["workload"] == report["workload"]  # the same requests
    assert run["requests"] == 7 and run["output_tokens"] == total and run["compiles_after_warmup"] == 0
    with pytest.raises(ValueError, match="concurrency"):
        bench.main(["serving", "--url", url, "--concurrency", "0", *COMMON])
