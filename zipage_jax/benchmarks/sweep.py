"""Accuracy against KV budget for several scoring configurations in one process: `python -m zipage_jax.bench sweep`.

    python -m zipage_jax.bench sweep --data synthetic:test:200 --data synthetic:interleaved_sums:test:200 \\
        --budgets 4,6,9,19 --page-size 16 --output sweep.json --plot sweep.png

A configuration is a set of `EngineConfig` overrides (`--config NAME:field=value,field=value`, e.g.
`--config no-global:global_score=false`); without `--config` the grid is `ABLATIONS`, the scoring
components of the paper's default taken out one at a time, plus the window-only and full-KV baselines.
Budgets are per-request (`SamplingParams.kv_budget_pages`), so one engine serves every budget of a
configuration, and every data set, in one batched `generate`; an engine is built only for each distinct set
of overrides. Prints one table (accuracy per configuration and budget, for each data set), and writes the JSON
(after every configuration, so a run cut short keeps what it finished) and one plot of accuracy against budget,
a line per configuration and a panel per data set. The budget axis is `M * page_size` as a share of the mean
full-KV output, when the grid has a full-KV configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from zipage_jax.config import EngineConfig, add_engine_options, option_error, option_fields
from zipage_jax.config import engine_kwargs as set_options
from zipage_jax.entrypoints.answers import is_correct
from zipage_jax.entrypoints.eval import DEFAULT_MAX_TOKENS, format_prompt, load_items

FULL_KV = "full-kv"
ABLATIONS = {  # name -> EngineConfig overrides (the engine's other defaults apply)
    FULL_KV: {"compression": False},
    "default": {},
    "no-global": {"global_score": False},
    "no-pooling": {"pooling": False},
    "no-redundancy": {"redundancy": "off"},
    "rkv-like": {"global_score": False, "pooling": False, "redundancy": "full"},
    "window-only": {"eviction_policy": "window"},
}


# -- grid -------------------------------------------------------------------------------------------------------
def parse_value(text: str):
    """`true`/`false`, `none`, an int, a float, else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_config(spec: str) -> tuple[str, dict]:
    """`NAME:field=value,field=value` (or `NAME` alone, or `NAME:`) -> (name, overrides); fields are checked
    against `EngineConfig` (an unknown one raises ValueError naming it)."""
    name, _, body = spec.partition(":")
    if not name:
        raise ValueError(f"config: expected NAME:field=value,..., got {spec!r}")
    fields = set(option_fields())
    overrides = {}
    for pair in filter(None, body.split(",")):
        key, eq, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise ValueError(f"config: {pair!r} of {spec!r} is not field=value with an EngineConfig field")
        overrides[key] = parse_value(value.strip())
    return name, overrides


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"budgets: expected comma-separated page counts, got {text!r}") from None
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets: expected page counts >= 1, got {text!r}")
    return budgets


def engine_kwargs(base: dict, overrides: dict, budgets: list[int]) -> dict:
    """The engine of one configuration: compression on (unless overridden off), sized for the largest budget."""
    kwargs = {"compression": True, **base, **overrides}
    if kwargs["compression"]:
        kwargs["kv_budget_pages"] = max(budgets)
    return kwargs


# -- running ----------------------------------------------------------------------------------------------------
def run_config(llm, datasets: dict[str, list[dict]], budgets: list[int | None], max_tokens: int,
               use_tqdm: bool = False) -> list[dict]:
    """One batched generate over every (data set, budget, item); one result row per (data set, budget).

    A budget of None runs the engine's own (full KV when compression is off). Greedy decoding.
    """
    from zipage_jax.sampling_params import SamplingParams

    cells, prompts, params = [], [], []
    for data, items in datasets.items():
        for budget in budgets:
            cells.append((data, budget, items))
            for item in items:
                prompts.append(format_prompt(llm.tokenizer, item["question"]))
                params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_budget_pages=budget))
    start = time.perf_counter()
    outputs = iter(llm.generate(prompts, params, use_tqdm=use_tqdm))
    elapsed = time.perf_counter() - start
    rows = []
    for data, budget, items in cells:
        done = [next(outputs) for _ in items]
        lengths = [len(out.outputs[0].token_ids) for out in done]
        rows.append({
            "data": data, "budget": budget, "num_questions": len(items),
            "accuracy": statistics.fmean(is_correct(o.outputs[0].text, item["answer"]) for o, item in zip(done, items)),
            "mean_output_tokens": statistics.fmean(lengths),
            "compressions_per_request": statistics.fmean(o.metrics.get("num_compressions", 0) for o in done),
        })
    for row in rows:
        row["config_seconds"] = round(elapsed, 1)
    return rows


def sweep(model: str, datasets: dict[str, list[dict]], configs: dict[str, dict], budgets: list[int],
          base: dict | None = None, max_tokens: int = DEFAULT_MAX_TOKENS, on_config=None, deadline_s=None,
          use_tqdm: bool = False) -> dict:
    """Run the grid; `on_config(report)` after each configuration. Configurations with equal engine kwargs
    share one engine; past `deadline_s` seconds the remaining configurations are skipped (listed)."""
    from zipage_jax.engine.llm import LLM

    base = dict(base or {})
    report = {"model": model, "data": list(datasets), "budgets": budgets, "page_size": None,
              "configs": configs, "engine_base": base, "results": [], "skipped": []}
    start = time.perf_counter()
    by_engine: dict[str, list[str]] = {}
    for name, overrides in configs.items():
        key = json.dumps(engine_kwargs(base, overrides, budgets), sort_keys=True, default=str)
        by_engine.setdefault(key, []).append(name)
    for key, names in by_engine.items():
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            report["skipped"] += names
            continue
        kwargs = json.loads(key)
        t0 = time.perf_counter()
        llm = LLM(model, **kwargs)
        report["page_size"] = llm.engine.config.page_size
        rows = run_config(llm, datasets, budgets if kwargs["compression"] else [None], max_tokens, use_tqdm)
        del llm
        gc.collect()  # the next engine allocates its own pool
        for name in names:
            report["results"] += [{"config": name, **row, "engine_seconds": round(time.perf_counter() - t0, 1)}
                                  for row in rows]
        if on_config is not None:
            on_config(report)
    return report


# -- reporting --------------------------------------------------------------------------------------------------
def full_kv_rows(report: dict) -> dict[str, dict]:
    """data set -> its full-KV result row (budget None), where the grid has one."""
    return {r["data"]: r for r in report["results"] if r["budget"] is None}


def table(report: dict) -> str:
    """Markdown: one block per data set, a row per configuration, a column per budget (pages, share of output)."""
    full = full_kv_rows(report)
    page = report["page_size"] or 0
    lines = []
    for data in report["data"]:
        reference = full.get(data)
        header = []
        for budget in report["budgets"]:
            share = f" ≈{100 * budget * page / reference['mean_output_tokens']:.0f} %" if reference else ""
            header.append(f"M={budget}{share}")
        lines += [f"{data}" + (f" (full KV: {100 * reference['accuracy']:.1f} %, mean output "
                               f"{reference['mean_output_tokens']:.0f} tokens)" if reference else ""),
                  "", "| configuration | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
        for name in report["configs"]:
            rows = {r["budget"]: r for r in report["results"] if r["config"] == name and r["data"] == data}
            if not rows or None in rows:
                continue
            cells = []
            for budget in report["budgets"]:
                r = rows.get(budget)
                cells.append("—" if r is None else f"{100 * r['accuracy']:.1f} %"
                             + (f" ({100 * r['accuracy'] / reference['accuracy']:.0f} % of full)"
                                if reference and reference["accuracy"] > 0 else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path=None):
    """Accuracy against budget, a line per configuration, a panel per data set (full KV dashed). Saved to `path`
    (and closed) when given; the figure is returned either way."""
    import matplotlib.pyplot as plt

    full = full_kv_rows(report)
    page = report["page_size"] or 1
    fig, axes = plt.subplots(1, len(report["data"]), figsize=(6 * len(report["data"]), 4.2), squeeze=False)
    for ax, data in zip(axes[0], report["data"]):
        reference = full.get(data)
        scale = 100 * page / reference["mean_output_tokens"] if reference else 1
        for name in report["configs"]:
            rows = sorted((r for r in report["results"] if r["config"] == name and r["data"] == data
                           and r["budget"] is not None), key=lambda r: r["budget"])
            if rows:
                ax.plot([r["budget"] * scale for r in rows], [100 * r["accuracy"] for r in rows], "o-", label=name)
        if reference:
            ax.axhline(100 * reference["accuracy"], color="k", ls="--", lw=1, label=FULL_KV)
        ax.set_xlabel("KV budget M·S, % of the mean full-KV output" if reference else "KV budget M (pages)")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(data)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


# -- command line -----------------------------------------------------------------------------------------------
def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from zipage_jax.config import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench sweep", description=__doc__.splitlines()[0])
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--model", default=DEFAULT_MODEL, help="HF-layout model directory (default: the shipped model)")
    sw.add_argument("--data", action="append", required=True,
                    help="JSONL of {question, answer} lines or synthetic:[TASK:]SPLIT:N[:SEED]; repeat for several")
    sw.add_argument("--limit", type=int, default=None, help="only the first K questions of each data set")
    sw.add_argument("--budgets", default="4,6,9,19", help="KV budgets M in pages (default: %(default)s)")
    sw.add_argument("--config", action="append", default=None, metavar="NAME:field=value,...",
                    help=f"a configuration of EngineConfig overrides; repeat (default: {', '.join(ABLATIONS)})")
    sw.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="(default: %(default)s)")
    sw.add_argument("--output", default=None, help="write the JSON report here")
    sw.add_argument("--plot", default=None, help="write the accuracy-vs-budget plot (PNG) here")
    sw.add_argument("--deadline-s", type=float, default=None,
                    help="start no further configuration after this many seconds")
    sw.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                    help="progress bar per configuration (default: %(default)s)")
    return parser, add_engine_options(parser)


def main(argv: list[str] | None = None) -> dict:
    parser, engine_fields = build_parser()
    args = parser.parse_args(argv)
    base = set_options(args, engine_fields)
    try:
        budgets = parse_budgets(args.budgets)
        configs = dict(parse_config(spec) for spec in args.config) if args.config else dict(ABLATIONS)
        for overrides in configs.values():
            EngineConfig.from_kwargs(args.model, **engine_kwargs(base, overrides, budgets))  # validate before loading
        datasets = {data: load_items(data)[:args.limit] for data in args.data}
    except ValueError as e:
        option_error(parser, e)
    if not Path(args.model).is_dir():
        parser.error(f"--model: no model directory at {args.model!r}")

    def write(report):
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    def done(report):
        write(report)
        last = report["results"][-1]
        print(f"{last['config']}: engine built and run in {last['engine_seconds']:.1f}s", flush=True)

    report = sweep(args.model, datasets, configs, budgets, base, args.max_tokens, on_config=done,
                   deadline_s=args.deadline_s, use_tqdm=args.progress)
    write(report)
    print(table(report))
    if report["skipped"]:
        print(f"skipped (deadline): {', '.join(report['skipped'])}")
    if args.plot and report["results"]:
        import matplotlib

        matplotlib.use("Agg")  # a file, no display
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
