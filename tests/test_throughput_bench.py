"""`python -m zipage_jax.bench throughput --small`: the CI smoke of the throughput campaign (tiny model, CPU), its
report format, the named workloads' shapes, and the long-reasoning closed loop and its steady window."""

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from zipage_jax import bench
from zipage_jax.config import EngineConfig
from zipage_jax.benchmarks import closed_loop, throughput, throughput_report, workloads
from zipage_jax.benchmarks import throughput as throughput_bench
from zipage_jax.benchmarks.model_shapes import hbm_peak_bytes_per_s


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """One executable store for the module's small runs: they share the engine shapes of --small, so the later run
    (on the same worker) loads the earlier's programs instead of compiling them again (seconds, not tens)."""
    return str(tmp_path_factory.mktemp("programs"))


@pytest.fixture(scope="module")
def small_report(tmp_path_factory, programs):
    out = tmp_path_factory.mktemp("throughput")
    report, _ = bench.main(["throughput", "--small", "--json", str(out / "t.json"), "--png", str(out / "t.png"),
                            "--compilation-cache-dir", programs])
    return report, out


@pytest.fixture(scope="module")
def long_reasoning_report(programs):
    report, _ = bench.main(["throughput", "--small", "--workload", "long-reasoning",
                            "--compilation-cache-dir", programs])
    return report


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
        assert set(throughput_report.HEADER.split()) and throughput_report.format_row(r).split()[0] == r["mode"]
    full, compressed = report["results"]
    budget = 2  # M of --small: a compressed request holds at most M+1 pages after its first compression
    assert full["num_compressions"] == 0 and compressed["num_compressions"] > 0
    # every compressed request went through one dispatch of its shape, each within its row bucket
    dispatches = compressed["compression_dispatches"]
    assert full["compression_dispatches"] == [] and sum(d["requests"] for d in dispatches) == \
        compressed["num_compressions"]
    assert all(d["dispatches"] <= d["requests"] <= d["dispatches"] * d["rows"] and d["seconds"] > 0
               for d in dispatches)
    assert {d["budget"] for d in dispatches} == {budget} and min(d["width"] for d in dispatches) == budget + 1
    assert compressed["mode"] + ": compression dispatches " in throughput_report.format_report(report)
    assert compressed["num_preemptions"] == 0 and full["num_preemptions"] > 0  # the small pool forces recomputes
    assert max(h["pages_per_running_max"] for h in compressed["history"]) <= max(
        budget + 1, -(-workload["prompt_tokens_max"] // 16) + 1)
    assert set(report["ratios"]) >= {"compressed / full (steady)", "compressed / full (incl. start-up)"}
    text = throughput_report.format_report(report)
    assert throughput_report.HEADER in text and "compressed / full (steady)" in text


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workloads_have_their_documented_shape(name):
    budget, page, vocab, max_len = 2048, 256, 151936, 32768
    w = workloads.make_workload(name, 2000, budget, page, vocab, max_len, seed=1)
    assert len(w.prompts) == len(w.max_tokens) == 2000
    assert all(len(p) + m <= max_len and m >= 1 for p, m in zip(w.prompts, w.max_tokens))
    assert all(0 <= t < vocab for p in w.prompts[:20] for t in p)
    mean = np.mean(w.max_tokens)
    if name == "reasoning":
        assert mean >= 4 * budget and np.percentile(w.max_tokens, 99) > 3 * mean  # long-tailed
        assert len({tuple(p[:page]) for p in w.prompts}) == 1 and max(map(len, w.prompts)) < 2 * page
    elif name == "long-reasoning":  # the paper's regime: outputs of >= 6 budgets on average, up to ~32k
        assert mean >= 6 * budget and np.percentile(w.max_tokens, 99) > 2 * mean
        assert max(w.max_tokens) > max_len - 2 * page and min(w.max_tokens) >= budget // 2
        assert len({tuple(p[:page]) for p in w.prompts}) == 1 and max(map(len, w.prompts)) < page + page // 2
    elif name == "mixed":
        short, long = w.max_tokens[0::2], w.max_tokens[1::2]
        assert max(short) < budget // 2 and np.mean(long) >= 4 * budget
    else:
        assert len({tuple(p[:4 * page]) for p in w.prompts}) == 4 and min(map(len, w.prompts)) >= 4 * page
    again = workloads.make_workload(name, 2000, budget, page, vocab, max_len, seed=1)
    assert again == w  # seeded


def test_bad_workload_arguments_raise():
    with pytest.raises(ValueError, match="workload"):
        workloads.make_workload("nope", 4, 64, 16, 128, 512)
    with pytest.raises(ValueError, match="requests"):
        workloads.make_workload("reasoning", 0, 64, 16, 128, 512)


def test_a_failing_peer_is_reported_not_raised(tmp_path):
    """The peer runs in a subprocess: without torch or a GPU (as here) it fails, and the report says why."""
    import argparse

    args = argparse.Namespace(model=None, model_shape="tiny", peer_requests=2, peer_duration=1.0, peer_timeout=120.0)
    w = workloads.make_workload("reasoning", 4, 32, 16, 256, 256)
    config = EngineConfig.from_kwargs("random:tiny", page_size=16, max_num_seqs=4)
    result = throughput.run_peer(args, w, config, str(tmp_path))
    assert result["name"] == "hf" and result["requests"] == 2
    assert "tokens_per_s" not in result and result["error"]


def test_the_peer_steady_rate_leaves_out_its_ramp():
    """Slow for 4 s (admission, prefill), then 100 tok/s: the second half's rate is the steady one."""
    from zipage_jax.benchmarks.hf_peer import second_half_rate

    samples = [dict(time_s=t, generated=5 * t if t <= 4 else 20 + 100 * (t - 4)) for t in range(11)]
    assert second_half_rate(samples) == pytest.approx(100.0)
    assert second_half_rate([dict(time_s=0.0, generated=0)]) is None
    peer = dict(tokens_per_s=62.0, tokens_per_s_second_half=100.0)
    full = dict(mode="full", tokens_per_s=1000.0, steady_tokens_per_s=1500.0)
    assert throughput_report.ratios([full], peer) == {"full / hf peer (steady)": pytest.approx(1000 / 62),
                                               "full steady window / hf peer second half": pytest.approx(15.0)}


def test_admission_modes_run_compressed_under_that_admission_and_are_compared(monkeypatch):
    built, calls = [], []

    class Engine:  # records the config each mode builds; run_mode is stubbed below
        def __init__(self, config, params=None, **kwargs):
            built.append(config)

    def run_mode(mode, make_engine, *args, **kwargs):
        make_engine(mode)
        calls.append(kwargs)
        return dict(mode=mode, tokens_per_s={"compressed": 300.0, "compressed-hybrid": 200.0}.get(mode, 100.0))

    monkeypatch.setattr(throughput_bench, "run_mode", run_mode)
    monkeypatch.setattr("zipage_jax.engine.llm_engine.LLMEngine", Engine)
    monkeypatch.setattr(throughput_bench, "format_report", lambda report: "")
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--small", "--modes", "compressed", "compressed-hybrid", "compressed-constrained",
                              "--time-budget", "900"])
    before = time.perf_counter()
    report = throughput.main(args)
    after = time.perf_counter()
    # each mode's deadline: an equal share of what is left of the budget when it starts (the stubbed modes take no
    # time): 900/3, then 900/2 of what is left, then all of it
    for call, share in zip(calls, (300, 450, 900)):
        assert before + share <= call["deadline"] <= after + share
    assert all(c["concurrency"] is None for c in calls)  # the reasoning workload runs all at once
    assert [(c.compression, c.admission) for c in built] == [(True, "reserved"), (True, "hybrid"),
                                                             (True, "constrained")]
    assert report["ratios"]["compressed / compressed-hybrid (steady)"] == 1.5
    assert report["ratios"]["compressed / compressed-constrained (steady)"] == 3.0


def test_steady_window_leaves_out_the_ramp_and_the_tail():
    """Samples each second: a ramp at 10 tok/s to t=4, steady 100 tok/s to t=14, a drain at 20 tok/s to t=20; the
    loop stopped adding at 14.5 s. Skipping 100 tokens starts the window at t=5 (140 tokens, the first sample
    past 100); it ends at t=14 (1040 tokens): 900 tokens in 9 s."""
    def tokens(t):
        return 10 * t if t <= 4 else 40 + 100 * (t - 4) if t <= 14 else 1040 + 20 * (t - 14)

    samples = [(float(t), tokens(t)) for t in range(21)]
    assert closed_loop.steady_window(samples, 100, 14.5) == dict(start_s=5.0, end_s=14.0, tokens=900,
                                                                tokens_per_s=100.0)
    # without the loop's end the drain counts: (1160 - 140) / 15 s
    assert closed_loop.steady_window(samples, 100) == dict(start_s=5.0, end_s=20.0, tokens=1020, tokens_per_s=68.0)
    assert closed_loop.steady_window(samples, 2000, 14.5) is None  # never reached
    assert closed_loop.steady_window(samples, 1040, 14.5) is None  # starts where it ends: no time


def test_long_reasoning_small_run_is_a_closed_loop_with_a_steady_window(long_reasoning_report):
    report = long_reasoning_report
    workload, config = report["workload"], report["config"]
    assert workload["name"] == "long-reasoning" and config["concurrency"] == 3
    assert (config["page_size"], config["kv_budget_pages"]) == (16, 2)  # --small's, over the workload's
    for r in report["results"]:
        assert r["concurrency"] == 3 and r["complete"]
        assert r["requests_added"] == r["requests_finished"] == workload["requests"] == 6
        assert r["generated_tokens"] == workload["output_tokens_total"]
        history = r["history"]
        in_flight = [h["num_in_flight"] for h in history]
        assert max(in_flight) == 3  # never more than the loop's concurrency
        end = r["closed_loop_end_s"]
        # the loop held 3 in the engine until the workload ran out, then they drained (the tail)
        assert all(h["num_in_flight"] == 3 for h in history if h["time_s"] <= end)
        assert 0 < end < r["generation_s"] and in_flight[-2] < 3
        w = r["steady"]
        skip = 3 * 2 * 16  # one budget (M=2 pages of 16) per concurrent request: less than the pool (24 pages)
        assert w["skip_tokens"] == r["steady_skip_tokens"] == skip
        first = next(h for h in history if h["generated"] >= skip)
        last = [h for h in history if h["time_s"] <= end][-1]
        assert (w["start_s"], w["end_s"]) == (first["time_s"], last["time_s"])
        assert w["tokens"] == last["generated"] - first["generated"] > 0
        assert w["tokens_per_s"] == pytest.approx(w["tokens"] / (w["end_s"] - w["start_s"]))
        assert r["steady_tokens_per_s"] == w["tokens_per_s"] and 1 <= w["running_mean"] <= 3
        span = last["time_s"] - first["time_s"]  # the window's shares come from its own samples, not the run's
        assert w["compression_time_share"] == pytest.approx(
            (last["compression_seconds"] - first["compression_seconds"]) / span)
        assert w["hbm_roofline_fraction"] == pytest.approx(
            (last["bytes_read"] - first["bytes_read"]) / span / hbm_peak_bytes_per_s("cpu"))
        assert 0 < last["bytes_read"] - first["bytes_read"] < history[-1]["bytes_read"]
    full, compressed = report["results"]
    assert full["num_compressions"] == 0 and compressed["num_compressions"] > 0
    assert full["steady"]["compression_time_share"] == 0 < compressed["steady"]["compression_time_share"] < 1
    budget_pages = 2  # M=2: a compressed request holds at most M+1 pages
    assert compressed["steady"]["pages_per_running_mean"] <= budget_pages + 1
    assert max(h["pages_per_running_max"] for h in full["history"]) > budget_pages + 1
    text = throughput_report.format_report(report)
    assert "compressed: closed loop of 3" in text and "steady window" in text
    assert "compressed / full (steady window)" in report["ratios"]


def test_roofline_reads_each_card_against_its_own_peak():
    assert hbm_peak_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_peak_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_peak_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_peak_bytes_per_s("cpu") == 4.8e12  # a small case on a CPU reads against an H200


def test_long_reasoning_sets_the_papers_budget_unless_the_command_line_does():
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    shape = MODEL_SHAPES["qwen3-8b"]
    config = throughput.base_config(parser.parse_args(["--workload", "long-reasoning"]), shape)
    assert (config.page_size, config.kv_budget_pages, config.max_model_len) == (256, 8, 32768)
    config = throughput.base_config(parser.parse_args(["--workload", "long-reasoning", "--page-size", "128",
                                                       "--kv-budget-pages", "4"]), shape)
    assert (config.page_size, config.kv_budget_pages) == (128, 4)
    with pytest.raises(ValueError, match="concurrency"):
        throughput.main(parser.parse_args(["--workload", "long-reasoning", "--concurrency", "0"]))


def test_aged_start_enters_the_loop_mid_trace():
    """The first `count` requests are those a long-running loop's slots hold: drawn in proportion to their length
    (so their mean length is E[L^2] / E[L], not E[L]), each at an age uniform over it, its generated part in its
    prompt; every request keeps its prompt + output length, and the rest of the workload follows unchanged."""
    base = workloads.make_workload("long-reasoning", 4096, 2048, 256, 1000, 32768, seed=0)
    count = 384
    aged = workloads.aged_start(base, count, 1000, seed=0)
    assert len(aged.prompts) == len(base.prompts) and "aged start" in aged.description
    originals = {tuple(p): (i, o) for i, (p, o) in enumerate(zip(base.prompts, base.max_tokens))}
    sizes = sorted({len(p) for p in base.prompts})
    picked, fractions = [], []
    for prompt, output in zip(aged.prompts[:count], aged.max_tokens[:count]):
        i, total = next(originals[tuple(prompt[:n])] for n in sizes if tuple(prompt[:n]) in originals)
        age = len(prompt) - len(base.prompts[i])
        assert output == total - age >= 1
        picked.append(i)
        fractions.append(age / total)
    assert len(set(picked)) == count  # no request twice
    lengths = np.array(base.max_tokens, float)
    biased = (lengths ** 2).sum() / lengths.sum()
    assert abs(np.mean([base.max_tokens[i] for i in picked]) / biased - 1) < 0.08 and biased > 1.3 * lengths.mean()
    assert abs(np.mean(fractions) - 0.5) < 0.05 and min(fractions) < 0.05 and max(fractions) > 0.95
    rest = [i for i in range(len(base.prompts)) if i not in set(picked)]
    assert aged.prompts[count:] == [base.prompts[i] for i in rest[:len(base.prompts) - count]]
    with pytest.raises(ValueError, match="concurrency"):
        workloads.aged_start(base, 0, 1000)
    with pytest.raises(ValueError, match="aged_start"):
        bench.main(["throughput", "--small", "--aged-start", "--workload", "reasoning"])


def test_the_initial_prefill_ends_when_every_aged_request_was_through_its_prompt():
    """Samples each second: admission prefills a few long contexts at a time; at t=3 none is mid-prefill while
    admission waits for pages, and at t=5 the loop runs near its typical 10, but aged requests still wait: the
    initial prefill ends at t=7, when the last aged request is through its prompt (a fresh one may be mid-prefill)."""
    prefilling = [0, 3, 2, 0, 2, 1, 1, 1, 1, 0]
    running = [0, 3, 4, 4, 7, 9, 10, 10, 10, 10]
    unprefilled = [10, 7, 5, 5, 3, 2, 1, 0, 0, 0]
    samples = [dict(time_s=float(t), num_prefilling=p, num_running=r, num_aged_unprefilled=u)
               for t, (p, r, u) in enumerate(zip(prefilling, running, unprefilled))]
    assert closed_loop.prefill_over_s(samples) == 7.0
    assert closed_loop.prefill_over_s(samples, end_s=6.0) is None  # the loop stopped adding before it ended
    assert closed_loop.prefill_over_s(samples[:7]) is None


def test_aged_start_window_starts_when_the_initial_prefill_is_over(programs):
    report, _ = bench.main(["throughput", "--small", "--workload", "long-reasoning", "--aged-start",
                            "--compilation-cache-dir", programs])
    assert "aged start" in report["workload"]["description"]
    for r in report["results"]:
        history, w = r["history"], r["steady"]
        busy = next(i for i, h in enumerate(history) if h["num_prefilling"])
        assert r["aged_start"] and r["prefilled_s"] == w["start_s"] > history[busy]["time_s"]
        start = next(i for i, h in enumerate(history) if h["time_s"] == w["start_s"])
        assert history[start]["num_aged_unprefilled"] == 0 < history[start - 1]["num_aged_unprefilled"]
        # the window's compression share splits off the first compressions of the aged (wide) contexts
        assert 0 <= w["compression_time_share_at_budget"] <= w["compression_time_share"]
        wide = [d for d in r["compression_dispatches"] if d["width"] > d["budget"] + 1]
        assert (history[-1]["wide_compression_seconds"] > 0) == bool(wide)
        # as many aged requests as the mode holds at once; the others of the aged start run fresh (full length)
        assert 1 <= r["aged_residents"] <= 3 and (r["aged_residents"] == 3 or r["mode"] == "full")
        assert r["aged_history_tokens"] == (3 * 16 if r["mode"] == "compressed" else None)  # M = 2 pages of 16
        assert r["complete"] and r["generated_tokens"] == r["workload_output_tokens"]
        # the yardstick: the engine's own decode step at the window's mean shape, after the window
        cap = w["decode_capacity"]
        assert 1 <= cap["rows"] <= round(w["running_mean"]) and 1 <= cap["ctx"] <= round(cap["kv_tokens"])
        assert cap["tokens_per_s"] > 0 and w["capacity_efficiency"] == w["tokens_per_s"] / cap["tokens_per_s"]
        split = w["time_split"]
        in_steps = sum(k["seconds"] for k in split["kinds"].values())
        assert split["wall_s"] == pytest.approx(w["end_s"] - w["start_s"])
        assert in_steps + split["outside_steps_s"] == pytest.approx(split["wall_s"]) or in_steps > split["wall_s"]
        assert r["workload_output_tokens"] >= report["workload"]["output_tokens_total"]
    assert "after the initial prefill" in throughput_report.format_report(report)


def test_an_aged_start_keeps_as_many_aged_requests_as_a_mode_holds():
    """``with_residents``: the first k aged requests stay mid-trace, the other aged ones become fresh again (their
    original prompt and length), the rest untouched; ``resident_capacity``: compression holds its planned steady
    state, full KV as many contexts (in order) as its pool's pages fit."""
    base = workloads.make_workload("long-reasoning", 40, 64, 16, 1000, 512, seed=0)
    aged = workloads.aged_start(base, 6, 1000, seed=0)
    two = aged.with_residents(2)
    assert two.prompts[:2] == aged.prompts[:2] and two.max_tokens[:2] == aged.max_tokens[:2]
    assert list(zip(two.prompts[2:6], two.max_tokens[2:6])) == aged.fresh[2:6]
    assert two.prompts[6:] == aged.prompts[6:] and two.fresh is None and "2 of them resident" in two.description
    assert aged.with_residents(6) is aged and base.with_residents(1) is base
    for (prompt, out), p, o in zip(aged.fresh, aged.prompts, aged.max_tokens):  # ageing keeps each length
        assert len(prompt) + out == len(p) + o and p[:len(prompt)] == prompt
    # compressed mode's residents keep their prompt and only their latest generated tokens, their outputs whole
    capped = aged.with_residents(4, history_tokens=20)
    for i, ((prompt, _), p) in enumerate(zip(aged.fresh, aged.prompts)):
        if i >= 4:
            assert (capped.prompts[i], capped.max_tokens[i]) == aged.fresh[i]
            continue
        history = p[len(prompt):]
        assert capped.prompts[i] == prompt + history[-20:] and capped.max_tokens[i] == aged.max_tokens[i]
    assert any(len(p) - len(f) > 20 for (f, _), p in zip(aged.fresh[:4], aged.prompts))  # the cap cut something
    assert capped.prompts[6:] == aged.prompts[6:] and "latest 20 generated tokens" in capped.description
    assert aged.with_residents(6, history_tokens=10 ** 6).prompts == aged.prompts

    def engine(compression, num_pages, max_num_seqs=64):
        plan = SimpleNamespace(num_pages=num_pages, max_compressed_concurrency=5)
        config = SimpleNamespace(compression=compression, page_size=16, max_num_seqs=max_num_seqs)
        return SimpleNamespace(memory_plan=plan, config=config)

    assert closed_loop.resident_capacity(engine(True, 1000), aged) == 5
    pages = [len(p) // 16 + 1 for p in aged.prompts[:6]]
    assert closed_loop.resident_capacity(engine(False, 1 + sum(pages[:3])), aged) == 3
    assert closed_loop.resident_capacity(engine(False, 10_000), aged) == 6
    assert closed_loop.resident_capacity(engine(False, 10_000, max_num_seqs=4), aged) == 4


def test_steadiness_and_the_time_split_of_a_window():
    """Drift is the least-squares slope per minute relative to the mean; the rate's CV is over the second half of
    the window's per-sample rates; the split sorts every step of the window by kind and keeps the rest apart."""
    from zipage_jax.benchmarks.steady_state import StepTime, steadiness, time_split

    samples = [dict(time_s=float(t), num_running=100 + t, pages_per_running_mean=9.0,
                    generated=[0, 100, 200, 300, 400, 440, 540][t]) for t in range(7)]
    st = steadiness(samples)
    assert st["running_drift_per_min"] == pytest.approx(60 / 103)  # +1 a second around a mean of 103
    assert st["pages_per_running_drift_per_min"] == pytest.approx(0.0)
    second = [100.0, 40.0, 100.0]  # the last three of the six per-second rates
    assert st["second_half_rate_cv"] == pytest.approx(np.std(second) / np.mean(second))
    assert steadiness(samples[:2])["running_drift_per_min"] is None

    steps = [StepTime(0.5, 0.5, 0.1, 0, 64, 0, 0),  # before the window
             StepTime(1.2, 0.2, 0.15, 8, 0, 1, 0), StepTime(1.5, 0.3, 0.1, 8, 0, 0, 2),
             StepTime(2.1, 0.5, 0.2, 6, 100, 2, 0), StepTime(2.4, 0.1, 0.0, 0, 0, 0, 1),
             StepTime(3.5, 1.0, 0.5, 8, 0, 0, 0)]  # after it
    split = time_split(steps, 1.0, 3.0)
    assert split["steps"] == 4 and split["wall_s"] == 2.0
    assert split["outside_steps_s"] == pytest.approx(2.0 - 1.1)
    decode, mixed, other = (split["kinds"][k] for k in ("decode", "mixed", "other"))
    assert "prefill" not in split["kinds"]
    assert decode["steps"] == 2 and decode["ms_per_step"] == pytest.approx(250.0)
    assert decode["blocked_ms_per_step"] == pytest.approx(125.0) and decode["compression_steps"] == 1
    assert mixed["prefill_tokens_mean"] == 100 and other["share"] == pytest.approx(0.05)
    assert split["per_decode_step_ms"] == pytest.approx(2000 / 3)
    assert split["stalled_request_steps"] == 3 and split["stalled_per_decode_step"] == pytest.approx(1.0)


def test_the_capacity_probe_holds_no_more_rows_than_the_pool_fits(programs):
    """Full KV's window holds more rows than fit at once (it preempts): the probe measures as many rows of the
    window's context as the pool holds together, and says so."""
    import dataclasses

    import jax

    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.benchmarks.probes import HoldingScheduler
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.models import weights

    shape = MODEL_SHAPES["tiny"]
    config = EngineConfig.from_kwargs("random:tiny", page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=256, num_gpu_pages_override=40, compilation_cache_dir=programs)
    params = weights.init_random_params(shape, jax.random.key(0), jax.numpy.float32)
    engine = LLMEngine(dataclasses.replace(config, dtype="float32"), shape, params, scheduler_cls=HoldingScheduler)
    cap = closed_loop.decode_capacity(engine, rows=8, kv_tokens=150.4, steps=2)
    # 150 + 3 warm-up + 2 timed + 2 tokens of each row: 10 pages; the pool's 39 hold 3 rows
    assert (cap["rows"], cap["ctx"]) == (3, 150) and cap["tokens_per_s"] > 0
    assert not engine.has_unfinished_requests()
