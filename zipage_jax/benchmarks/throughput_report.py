"""The throughput benchmark's report: a line per mode, the steady windows, the compression profile, the ratios
between modes and to the HF peer, and the plot over time."""


HEADER = (f"{'mode':>10} {'tok/s':>8} {'steady':>8} {'2nd half':>8} {'w/ start':>8} {'start s':>7} {'gen s':>6} {'tokens':>8} "
          f"{'run avg':>7} {'peak':>5} {'occ':>5} {'preempt':>7} {'swaps':>5} {'stalls':>6} {'comp %':>6} "
          f"{'roofline':>8} {'compiles':>8}")


def format_row(r: dict) -> str:
    second, steady = r.get("tokens_per_s_second_half"), r.get("steady_tokens_per_s")
    return (f"{r['mode']:>10} {r['tokens_per_s']:>8.1f} {steady if steady is not None else float('nan'):>8.1f} "
            f"{second if second is not None else float('nan'):>8.1f} "
            f"{r['tokens_per_s_incl_startup']:>8.1f} {r['startup_s']:>7.1f} {r['generation_s']:>6.1f} "
            f"{r['generated_tokens']:>8d} {r['mean_running']:>7.1f} {r['peak_running']:>5d} "
            f"{r['mean_page_occupancy']:>5.0%} {r['num_preemptions']:>7d} {r['num_swaps']:>5d} "
            f"{r['stalled_request_steps']:>6d} {r['compression_time_share_steady']:>6.1%} "
            f"{r['hbm_roofline_fraction']:>8.1%} {r['compiles_after_warmup']:>8d}")


def format_steady(r: dict) -> str:
    """One line on a closed-loop run's steady window (or why it has none)."""
    w = r.get("steady")
    head = f"{r['mode']}: closed loop of {r['concurrency']}, {r['requests_added']} requests added, " \
           f"{r['requests_finished']} finished, pool {r['kv_pages']} pages"
    aged = r.get("aged_start")
    if not w:
        why = "the initial prefill did not end" if aged else f"fewer than {r.get('steady_skip_tokens')} tokens"
        return head + f"; no steady window ({why} before it ended)"
    after = "the initial prefill" if aged else f"{w['skip_tokens']} tokens"
    return (head + f"; steady window {w['start_s']:.1f}-{w['end_s']:.1f} s (after {after}): "
            f"{w['tokens_per_s']:.1f} tok/s, running {w['running_mean']:.1f}, pages per running request "
            f"{w['pages_per_running_mean']:.1f}, page occupancy {w['page_occupancy_mean']:.0%}, compression "
            f"{w['compression_time_share']:.1%} of the time ({w['compression_time_share_at_budget']:.1%} without "
            f"first compressions wider than M + 1 pages), decode steps at {w['hbm_roofline_fraction']:.0%} of the "
            f"HBM roofline")


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def format_yardstick(r: dict) -> str:
    """How a steady window measures up: its steadiness, its share of the decode step's capacity at its own shape,
    and where its time went, step kind by step kind."""
    w = r["steady"]
    st = w["steadiness"]
    cv = st["second_half_rate_cv"]
    lines = [f"{r['mode']}: steadiness: running {_pct(st['running_drift_per_min'])} a minute, pages per request "
             f"{_pct(st['pages_per_running_drift_per_min'])} a minute, rate over the second half varies "
             + ("n/a" if cv is None else f"{cv:.0%}") + " (CV)"]
    cap = w.get("decode_capacity")
    if "decode_capacity" in w and cap is None:
        lines.append(f"{r['mode']}: decode capacity not measured (see the log)")
    if cap:
        lines.append(f"{r['mode']}: decode capacity at {cap['rows']} rows x {cap['ctx']} tokens (window: "
                     f"{cap['kv_tokens']:.0f}): {cap['tokens_per_s']:.1f} tok/s ({cap['engine_step_ms']:.1f} ms a "
                     f"step, {cap['device_step_ms']:.1f} ms alone); the window delivers "
                     f"{w['capacity_efficiency']:.0%} of it")
    split = w["time_split"]
    parts = [f"{kind} {k['steps']} steps x {k['ms_per_step']:.1f} ms ({k['share']:.0%}; blocked "
             f"{k['blocked_ms_per_step']:.1f} + host {k['host_ms_per_step']:.1f}; {k['decode_rows_mean']:.0f} rows, "
             f"{k['prefill_tokens_mean']:.0f} prefill tokens, {k['compression_steps']} with compressions)"
             for kind, k in split["kinds"].items()]
    lines.append(f"{r['mode']}: window time: {split['per_decode_step_ms']:.1f} ms per decoding step; "
                 + "; ".join(parts) + f"; outside steps {split['outside_steps_s']:.1f} s; "
                 f"{split['stalled_per_decode_step']:.1f} stalled rows per decoding step")
    return "\n".join(lines)


def format_compressions(r: dict) -> str:
    """One line on a mode's compression dispatches by shape: how many, how full, and what one costs."""
    parts = []
    for d in r["compression_dispatches"]:
        cost = f" at {d['seconds'] * 1e3:.2f} ms" if d["seconds"] is not None else ""
        parts.append(f"{d['rows']} rows x {d['width']} pages: {d['dispatches']} ({d['requests']} requests){cost}")
    return f"{r['mode']}: compression dispatches " + "; ".join(parts)


def format_report(report: dict) -> str:
    lines = [f"throughput benchmark, workload {report['workload']['name']}: {report['workload']['description']}",
             f"{report['workload']['requests']} requests, outputs mean {report['workload']['output_tokens_mean']:.0f} "
             f"(p99 {report['workload']['output_tokens_p99']:.0f}) tokens; {report['config']}", HEADER]
    lines += [format_row(r) for r in report["results"]]
    lines += [format_steady(r) for r in report["results"] if r.get("concurrency")]
    lines += [format_yardstick(r) for r in report["results"] if r.get("steady")]
    lines += [format_compressions(r) for r in report["results"] if r.get("compression_dispatches")]
    ratios = report.get("ratios", {})
    lines += [f"{k}: {v:.2f}x" for k, v in ratios.items() if v is not None]
    peer = report.get("peer")
    if peer:
        second = peer.get("tokens_per_s_second_half")
        lines.append(f"peer {peer.get('name')}: " + (f"{peer['tokens_per_s']:.1f} tok/s"
                                                    + (f" ({second:.1f} over the second half)" if second else "")
                                                    + f", {peer['generated_tokens']} tokens in "
                                                    f"{peer['generation_s']:.1f}s ({peer['requests']} requests)"
                                                    if "tokens_per_s" in peer else f"failed: {peer.get('error')}"))
    return "\n".join(lines)


def ratios(results: list, peer: dict | None) -> dict:
    by = {r["mode"]: r for r in results}
    out = {}
    if "full" in by and "compressed" in by:
        full, comp = by["full"], by["compressed"]
        out["compressed / full (steady)"] = comp["tokens_per_s"] / full["tokens_per_s"]
        if comp.get("steady_tokens_per_s") and full.get("steady_tokens_per_s"):
            out["compressed / full (steady window)"] = comp["steady_tokens_per_s"] / full["steady_tokens_per_s"]
        if comp["tokens_per_s_second_half"] and full["tokens_per_s_second_half"]:
            out["compressed / full (second half)"] = (comp["tokens_per_s_second_half"]
                                                      / full["tokens_per_s_second_half"])
        out["compressed / full (incl. start-up)"] = (comp["tokens_per_s_incl_startup"]
                                                     / full["tokens_per_s_incl_startup"])
    for other in ("compressed-hybrid", "compressed-constrained"):
        if "compressed" in by and other in by:
            out[f"compressed / {other} (steady)"] = by["compressed"]["tokens_per_s"] / by[other]["tokens_per_s"]
    if peer and peer.get("tokens_per_s") and "full" in by:
        out["full / hf peer (steady)"] = by["full"]["tokens_per_s"] / peer["tokens_per_s"]
        full_steady, peer_steady = by["full"].get("steady_tokens_per_s"), peer.get("tokens_per_s_second_half")
        if full_steady and peer_steady:  # both at their steady state: the engine's window, the peer's second half
            out["full steady window / hf peer second half"] = full_steady / peer_steady
    return out


def plot(report: dict, path: str):
    """Throughput and concurrency over time, page occupancy, and pages per running request, one colour a mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    (rate, conc), (occ, pages) = axes
    for i, r in enumerate(report["results"]):
        h, c = r["history"], f"C{i}"
        t = [x["time_s"] for x in h]
        gen = [x["generated"] for x in h]
        rates = [(g1 - g0) / max(t1 - t0, 1e-9) for t0, t1, g0, g1 in zip(t, t[1:], gen, gen[1:])]
        rate.plot(t[1:], rates, c, label=f"{r['mode']} ({r['tokens_per_s']:.0f} tok/s)")
        if r.get("steady"):  # the closed loop's steady window
            w = r["steady"]
            rate.axvspan(w["start_s"], w["end_s"], color=c, alpha=0.1,
                         label=f"{r['mode']} steady window ({w['tokens_per_s']:.0f} tok/s)")
        conc.plot(t, [x.get("num_running", 0) for x in h], c, label=f"{r['mode']} running")
        conc.plot(t, [x.get("num_waiting", 0) for x in h], c, ls=":", label=f"{r['mode']} waiting")
        occ.plot(t, [x.get("page_occupancy", 0) for x in h], c, label=r["mode"])
        pages.plot(t, [x.get("pages_per_running_mean", 0) for x in h], c, label=f"{r['mode']} mean")
        pages.plot(t, [x.get("pages_per_running_max", 0) for x in h], c, ls="--", label=f"{r['mode']} max")
    peer = report.get("peer") or {}
    if peer.get("tokens_per_s"):
        rate.axhline(peer["tokens_per_s"], color="k", ls=":", label=f"HF peer ({peer['tokens_per_s']:.0f} tok/s)")
    for ax, title in ((rate, "generated tokens/s"), (conc, "requests"), (occ, "KV page occupancy"),
                      (pages, "pages per running request")):
        ax.set_title(title)
        ax.set_xlabel("s since the requests were added")
        ax.legend(fontsize=7)
    config = report["config"]
    fig.suptitle(f"{report['workload']['name']}, {config['model']} on {config.get('device_kind')}: page "
                 f"{config['page_size']}, M={config['kv_budget_pages']}, {report['workload']['requests']} requests",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
