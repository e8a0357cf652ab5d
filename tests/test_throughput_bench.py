"""`python -m zipage_jax.bench throughput --small`: the CI smoke of the throughput campaign (tiny model, CPU), its
report format, and the named workloads' shapes."""

import argparse
import json

import numpy as np
import pytest

from zipage_jax import bench
from zipage_jax.config import EngineConfig
from zipage_jax.benchmarks import throughput
from zipage_jax.benchmarks import throughput as throughput_bench


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    report, _ = bench.main(["throughput", "--small", "--json", str(out / "t.json"), "--png", str(out / "t.png")])
    return report, out


def test_small_run_reports_both_modes_in_the_documented_format(small_report, capsys):
    report, out = small_report
    assert json.loads((out / "t.json").read_text())["results"] == json.loads(json.dumps(report["results"]))
    assert (out / "t.png").stat().st_size > 0
    workload = report["workload"]
    assert [r["mode"] for r in report["results"]] == ["full", "compressed"]
    for r in report["results"]:
        # ran to completion: every request got exactly its max_tokens, in both modes
        assert r["complete"] and r["requests_finished"] == workload["requests"]
        assert r["generated_tokens"] == workload["output_tokens_total"]
        assert 0 < r["tokens_per_s_incl_startup"] < r["tokens_per_s"]
        assert 1 <= r["mean_running"] <= r["peak_running"] <= 4  # max_num_seqs of --small
        assert 0 < r["mean_page_occupancy"] <= r["peak_page_occupancy"] <= 1
        assert r["history"][-1]["generated"] == r["generated_tokens"]
        assert [h["time_s"] for h in r["history"]] == sorted(h["time_s"] for h in r["history"])
        assert sum(r["pages_per_request_peak"]) == workload["requests"]
        assert 0 <= r["compression_time_share_steady"] < 1 and r["hbm_roofline_fraction"] > 0
        assert set(throughput.HEADER.split()) and throughput.format_row(r).split()[0] == r["mode"]
    full, compressed = report["results"]
    budget = 2  # M of --small: a compressed request holds at most M+1 pages after its first compression
    assert full["num_compressions"] == 0 and compressed["num_compressions"] > 0
    assert compressed["num_preemptions"] == 0 and full["num_preemptions"] > 0  # the small pool forces recomputes
    assert max(h["pages_per_running_max"] for h in compressed["history"]) <= max(
        budget + 1, -(-workload["prompt_tokens_max"] // 16) + 1)
    assert set(report["ratios"]) >= {"compressed / full (steady)", "compressed / full (incl. start-up)"}
    text = throughput.format_report(report)
    assert throughput.HEADER in text and "compressed / full (steady)" in text


@pytest.mark.parametrize("name", throughput.WORKLOADS)
def test_workloads_have_their_documented_shape(name):
    budget, page, vocab, max_len = 2048, 256, 151936, 32768
    w = throughput.make_workload(name, 2000, budget, page, vocab, max_len, seed=1)
    assert len(w.prompts) == len(w.max_tokens) == 2000
    assert all(len(p) + m <= max_len and m >= 1 for p, m in zip(w.prompts, w.max_tokens))
    assert all(0 <= t < vocab for p in w.prompts[:20] for t in p)
    mean = np.mean(w.max_tokens)
    if name == "reasoning":
        assert mean >= 4 * budget and np.percentile(w.max_tokens, 99) > 3 * mean  # long-tailed
        assert len({tuple(p[:page]) for p in w.prompts}) == 1 and max(map(len, w.prompts)) < 2 * page
    elif name == "mixed":
        short, long = w.max_tokens[0::2], w.max_tokens[1::2]
        assert max(short) < budget // 2 and np.mean(long) >= 4 * budget
    else:
        assert len({tuple(p[:4 * page]) for p in w.prompts}) == 4 and min(map(len, w.prompts)) >= 4 * page
    again = throughput.make_workload(name, 2000, budget, page, vocab, max_len, seed=1)
    assert again == w  # seeded


def test_bad_workload_arguments_raise():
    with pytest.raises(ValueError, match="workload"):
        throughput.make_workload("nope", 4, 64, 16, 128, 512)
    with pytest.raises(ValueError, match="requests"):
        throughput.make_workload("reasoning", 0, 64, 16, 128, 512)


def test_a_failing_peer_is_reported_not_raised(tmp_path):
    """The peer runs in a subprocess: without torch or a GPU (as here) it fails, and the report says why."""
    import argparse

    args = argparse.Namespace(model=None, model_shape="tiny", peer_requests=2, peer_duration=1.0, peer_timeout=120.0)
    w = throughput.make_workload("reasoning", 4, 32, 16, 256, 256)
    config = EngineConfig.from_kwargs("random:tiny", page_size=16, max_num_seqs=4)
    result = throughput.run_peer(args, w, config, str(tmp_path))
    assert result["name"] == "hf" and result["requests"] == 2
    assert "tokens_per_s" not in result and result["error"]


def test_admission_modes_run_compressed_under_that_admission_and_are_compared(monkeypatch):
    built = []

    class Engine:  # records the config each mode builds; run_mode is stubbed below
        def __init__(self, config, params=None):
            built.append(config)

    def run_mode(mode, make_engine, *args, **kwargs):
        make_engine(mode)
        return dict(mode=mode, tokens_per_s={"compressed": 300.0, "compressed-hybrid": 200.0}.get(mode, 100.0))

    monkeypatch.setattr(throughput_bench, "run_mode", run_mode)
    monkeypatch.setattr("zipage_jax.engine.llm_engine.LLMEngine", Engine)
    monkeypatch.setattr(throughput_bench, "format_report", lambda report: "")
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--small", "--modes", "compressed", "compressed-hybrid", "compressed-constrained"])
    report = throughput.main(args)
    assert [(c.compression, c.admission) for c in built] == [(True, "reserved"), (True, "hybrid"),
                                                             (True, "constrained")]
    assert report["ratios"]["compressed / compressed-hybrid (steady)"] == 1.5
    assert report["ratios"]["compressed / compressed-constrained (steady)"] == 3.0
