"""The accuracy sweep (`python -m zipage_jax.benchmarks.sweep`): grid parsing, engines shared between equal configurations,
per-request budgets equal to an engine-wide budget, table, plot and JSON."""

import json

import pytest

import zipage_jax.engine.llm
from zipage_jax.entrypoints.eval import evaluate, load_items
from zipage_jax.benchmarks.sweep import ABLATIONS, main, parse_budgets, parse_config, parse_value

MODEL = "tests/fixtures/hf/qwen3"  # random weights, character tokenizer, no chat template
DATA = ["synthetic:test:2", "synthetic:interleaved_sums:test:2"]


def test_grid_parsing():
    assert parse_config("no-global:global_score=false,decay=0.5") == ("no-global", {"global_score": False,
                                                                                    "decay": 0.5})
    assert parse_config("w:eviction-policy=window,sink_tokens=4") == ("w", {"eviction_policy": "window",
                                                                            "sink_tokens": 4})
    assert parse_config("plain") == ("plain", {}) and parse_config("plain:") == ("plain", {})
    assert [parse_value(v) for v in ("True", "none", "3", "0.25", "full")] == [True, None, 3, 0.25, "full"]
    for bad in (":decay=0.5", "x:decay", "x:no_such_knob=1", "x:model=other"):
        with pytest.raises(ValueError, match="config"):
            parse_config(bad)
    assert parse_budgets("9, 4,4") == [4, 9]
    for bad in ("", "0,4", "four"):
        with pytest.raises(ValueError, match="budgets"):
            parse_budgets(bad)
    assert ABLATIONS["default"] == {} and ABLATIONS["full-kv"] == {"compression": False}


def test_bad_options_name_the_option(capsys):
    for argv, option in ((["--budgets", "0"], "--budgets"), (["--config", "x:decay=7"], "--decay"),
                         (["--config", "x:bogus=1"], "--config")):
        with pytest.raises(SystemExit):
            main(["--model", MODEL, "--data", DATA[0], *argv])
        assert option in capsys.readouterr().err


def test_sweep_shares_engines_and_matches_an_engine_wide_budget(tmp_path, monkeypatch, capsys):
    built = []
    original = zipage_jax.engine.llm.LLM

    def counting(*args, **kwargs):
        built.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(zipage_jax.engine.llm, "LLM", counting)
    engine = ["--page-size", "16", "--max-num-seqs", "16", "--max-model-len", "192", "--compilation-cache-dir", "none"]
    argv = ["--model", MODEL, "--data", DATA[0], "--data", DATA[1], "--budgets", "3,2", "--max-tokens", "96",
            "--config", "full-kv:compression=false", "--config", "a:global_score=false",
            "--config", "b:global-score=false", "--config", "window:eviction_policy=window",
            "--output", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"), *engine]
    report = main(argv)
    assert len(built) == 3  # a and b share one engine
    assert all(k["kv_budget_pages"] == 3 for k in built if k["compression"])
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["results"] == report["results"] and saved["budgets"] == [2, 3]
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    rows = {(r["config"], r["data"], r["budget"]): r for r in report["results"]}
    assert set(rows) == ({("full-kv", d, None) for d in DATA}
                         | {(c, d, b) for c in ("a", "b", "window") for d in DATA for b in (2, 3)})
    assert rows[("a", DATA[1], 2)] == {**rows[("b", DATA[1], 2)], "config": "a"}
    assert rows[("a", DATA[0], 2)]["compressions_per_request"] > rows[("a", DATA[0], 3)]["compressions_per_request"]
    assert rows[("full-kv", DATA[0], None)]["compressions_per_request"] == 0
    out = capsys.readouterr().out
    assert "| a |" in out and "| window |" in out and DATA[1] in out
    # the per-request budget of the sweep is the engine-wide budget of a plain evaluation
    llm = original(MODEL, page_size=16, max_num_seqs=16, max_model_len=192, compilation_cache_dir=None,
                   compression=True, kv_budget_pages=2, global_score=False)
    plain = evaluate(llm, load_items(DATA[1]), use_tqdm=False, max_tokens=96)
    cell = rows[("a", DATA[1], 2)]
    assert cell["accuracy"] == plain["accuracy"]
    assert cell["mean_output_tokens"] == plain["mean_output_tokens"]
    assert cell["compressions_per_request"] == plain["compressions_per_request"]["mean"] > 0
