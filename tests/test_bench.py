"""CPU smoke tests of the engine benchmark commands (tiny shape): decode runs, its byte accounting is right and
the engine loop it drives decodes what the dense oracle decodes; scheduling runs its variants; ttft's chunked
prefill samples the dense oracle's first token."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax import bench
from zipage_jax.benchmarks.decode import decode_benchmark
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.models import weights
from zipage_jax.models import forward_dense

CTX, STEPS, WARMUP = 20, 3, 3
ARGS = ["decode", "--model-shape", "tiny", "--batch", "1", "3", "--ctx", str(CTX), "--steps", str(STEPS),
        "--warmup-steps", str(WARMUP), "--page-size", "16", "--dtype", "float32", "--max-num-batched-tokens", "32",
        "--max-num-prefill-seqs", "2"]  # the engine's own options


def test_decode_command_report_and_tokens(tmp_path):
    out = tmp_path / "decode.json"
    _, outputs = bench.main(ARGS + ["--profile", "--json", str(out)])
    report = json.loads(out.read_text())
    cfg = MODEL_SHAPES["tiny"]
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        # every batch decodes from the same prefilled state: kv lengths ctx+1+warmup .. ctx+warmup+steps
        assert r["mean_kv_len"] == pytest.approx(CTX + WARMUP + (STEPS + 1) / 2)
        assert r["kv_bytes"] == pytest.approx(r["batch"] * r["mean_kv_len"] * per_token)
        embed = cfg.vocab_size * cfg.hidden_size * 4
        assert r["weight_bytes"] == report["config"]["num_params"] * 4 - embed + r["batch"] * cfg.hidden_size * 4
        assert r["tokens_per_s"] > 0 and r["host_ms_per_step"] > 0
        profile = r["profile"]  # the CPU backend's XLA ops stand in for GPU kernels
        assert profile["launches"] > 0 and profile["busy_us"] > 0
        assert sum(profile["categories_us"].values()) == pytest.approx(profile["busy_us"])
        assert sum(k["us"] for k in profile["top_kernels"]) <= profile["busy_us"] * (1 + 1e-9)
    hlo = report["hlo"]
    assert hlo["pool_shape"] == f"f32[2,{report['config']['num_pages']},2,16,16]"
    assert sum(hlo["ops_producing_pool_shape"].values()) > 0 and hlo["pool_copies"] == 0  # donated: in place
    # the last batch's requests end with greedy tokens: 1 from prefill + warm-up + measured steps, decoded over
    # prompts whose pages came from the prefix cache (all but the last page) and a replayed last step
    new = 1 + WARMUP + STEPS
    params = weights.init_random_serving_params_stacked(cfg, jax.random.key(0), jnp.float32)  # the bench's weights
    dense = jax.jit(lambda tokens: forward_dense(params, cfg, tokens))
    assert len(outputs) == 3 and len({tuple(out.prompt_token_ids) for out in outputs}) == 3
    for out in outputs:
        ids = list(out.prompt_token_ids) + [0] * new  # causal: the padding never affects earlier positions
        for i in range(CTX, CTX + new):
            ids[i] = int(jnp.argmax(dense(jnp.asarray([ids], jnp.int32))[0, i - 1]))
        assert out.outputs[0].token_ids == ids[CTX:] and out.metrics["num_cached_tokens"] == 16


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="model_shape"):
        decode_benchmark("nope", [1], ctx=8, steps=1)
    with pytest.raises(ValueError, match="batch"):
        decode_benchmark("tiny", [0], ctx=8, steps=1)
    with pytest.raises(ValueError, match="steps"):
        decode_benchmark("tiny", [1], ctx=8, steps=0)


def test_scheduling_command_runs_all_variants_with_identical_tokens(tmp_path):
    variants = ["async-reserved", "sync-hybrid", "async-constrained"]
    out, png = tmp_path / "sched.json", tmp_path / "sched.png"
    bench.main(["scheduling", "--model-shape", "tiny", "--requests", "4", "--prompt-len", "5", "--output-len", "60",
                "--kv-budget-pages", "1", "--page-size", "16", "--num-gpu-pages-override", "9",
                "--num-query-rows", "2", "--dtype", "float32", "--max-num-batched-tokens", "32",
                "--max-num-prefill-seqs", "2", "--metrics-interval-steps", "4", "--no-warmup",
                "--compilation-cache-dir", "none", "--json", str(out), "--png", str(png),
                "--variants", *variants])
    report = json.loads(out.read_text())
    results = report["results"]
    assert [f'{r["mode"]}-{r["admission"]}' for r in results] == variants
    for r in results:
        assert r["output_tokens"] == 4 * 60 and r["num_compressions"] > 0 and r["history"]
        assert r["host_ms_per_step"] > 0 and 0 <= r["compression_time_share"] <= 1
        assert r["sizing"]["num_query_rows"] == 2 and r["sizing"]["num_pages"] == 9
        assert r["tokens"] == results[0]["tokens"]  # greedy: every variant decodes the same, nothing lost
        running = max(h["num_running"] for h in r["history"])
        assert running <= 2 if r["admission"] == "constrained" else running > 2  # past the 2 query rows
    assert png.stat().st_size > 0


@pytest.mark.usefixtures("without_jax_cache")  # it starts on an executable store
def test_startup_command_cold_then_warm_and_ready_early_reports_programs_and_no_compiles_after_warmup(tmp_path):
    """Run twice on one store, as the cold and the warm figure are. Cold, every program compiles (and is stored) and
    the workload compiles nothing after the warm-up. Warm and ready early, the light load's programs are ready first
    (the smallest prefill bucket of three), loaded, not compiled; the workload waits on no compile while the others
    load in the background, and ``all_compiled_s`` comes after them."""
    from zipage_jax.config import DEFAULT_MODEL

    store = str(tmp_path / "store")
    options = ["--page-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "512",
               "--compilation-cache-dir", store]  # the engine options every CLI generates from EngineConfig
    for ready_early in (False, True):
        out = tmp_path / f"startup-{ready_early}.jsonl"
        report, _ = bench.main(["startup", "--model", DEFAULT_MODEL, *options, "--workload", "4", "--json", str(out)]
                               + ["--ready-early"] * ready_early)
        assert report["engine_options"] == dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                                                max_model_len=512, compilation_cache_dir=store)
        # decode at 8 rows, greedy and sampled; prefill at 16, 32, 64 tokens; the prompt-logprobs program; the
        # structured-output mask write at 8 rows
        if ready_early:  # warm: loaded from the store
            assert (report["programs"], report["background_programs"], report["loaded"]) == (2 * 1 + 1 + 1 + 1, 2, 5)
            assert report["all_compiled_s"] >= report["ready_s"]
        else:  # cold: compiled
            assert report["programs"] == 2 * 1 + 3 + 1 + 1 and report["background_programs"] == report["loaded"] == 0
        assert report["compiles_after_warmup"] == 0 and report["workload_tokens"] > 0
        assert report["ready_s"] >= report["init_s"] + report["compile_s"] * 0.99
        phases = report["init_phases_s"]  # LLM()'s seconds by phase, each inside it
        assert list(phases) == ["config", "backend", "plan_and_pool", "weights", "runner"]
        assert all(s >= 0 for s in phases.values()) and sum(phases.values()) <= report["init_s"]
        assert phases["weights"] == report["weights_s"]
        # the tokenizer's pipeline: built by a child process while the cold start ran, read from the store warm
        assert report["tokenizer"] == "StoredTokenizer" and report["tokenizer_wait_s"] >= 0
        # the pool's and the compression state's fills and the weights' conversions compile at every start, warm
        # too (their seconds are summed over the parallel weight loads, so they may exceed LLM()'s wall time)
        assert report["init_compiles"] >= 2 and report["init_compile_s"] > 0
        assert json.loads(out.read_text().splitlines()[-1])["programs"] == report["programs"]


def test_ttft_command_chunked_prefill_gives_the_dense_first_token(tmp_path):
    """The TTFT benchmark's engine, prefilling in 16-token chunks (each after its cached prefix), samples the first
    token the dense forward pass picks."""
    prompt_len, trials = 40, 1
    out = tmp_path / "ttft.json"
    report, _ = bench.main(["ttft", "--model-shape", "tiny", "--prompt-len", str(prompt_len), "--backends",
                            "reference", "--prefill-tokens", "16", "--trials", str(trials), "--page-size", "16",
                            "--dtype", "float32", "--json", str(out)])
    [row] = json.loads(out.read_text())["results"]
    assert row == report["results"][0]
    assert row["prefill_tokens"] == 16 and row["steps"] >= 3 and row["ttft_ms"] > 0
    cfg = MODEL_SHAPES["tiny"]
    params = weights.init_random_params(cfg, jax.random.key(0), jnp.float32)  # the benchmark's seed-0 weights
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=prompt_len) for _ in range(trials + 1)]
    dense = jax.jit(lambda tokens: forward_dense(params, cfg, tokens))
    expected = [int(jnp.argmax(dense(jnp.asarray([p], jnp.int32))[0, -1])) for p in prompts]
    assert row["first_tokens"] == expected


def documented_bench_commands():
    """Every ``python -m zipage_jax.bench ...`` command in README.md, BENCHMARKS.md and scripts/*.sh, as argv (shell
    variables become their default, a loop's value or 1; commands built from shell arrays or elided with ... skipped)."""
    import pathlib
    import re
    import shlex

    root = pathlib.Path(__file__).resolve().parents[1]
    commands = []
    for path in [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "scripts").glob("*.sh"))]:
        text = path.read_text().replace("\\\n", " ")
        for match in re.finditer(r"-m zipage_jax\.bench ((?:(?!\s\d?>)[^\n`|;&)#])*)", text):  # up to 2>&1 ...
            line = match.group(1)
            if "[@]" in line or "..." in line or len(line.split()) < 2:  # arrays, elisions, names in prose
                continue
            line = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", line)
            line = re.sub(r"\$\{?(\w+)\}?", lambda m: {"mode": "full", "dtype": "fp8"}.get(m.group(1), "1"), line)
            commands.append((path.name, shlex.split(line)))
    return commands


def test_documented_bench_commands_parse():
    import importlib

    from zipage_jax.benchmarks import cli, sweep, ttft

    commands = documented_bench_commands()
    assert {argv[0] for _, argv in commands} >= {"decode", "scheduling", "throughput", "serving", "startup", "sweep",
                                                 "ttft"}
    own = {"sweep": sweep.build_parser()[0], "ttft": ttft.build_parser()}  # command lines of their own
    own |= {name: importlib.import_module(module).build_parser() for name, (module, _) in cli.OWN_COMMAND_LINE.items()
            if name not in own | {"compression": None}}
    for where, argv in commands:
        if argv[0] == "compression":
            continue  # its own kernel-level command line (tests/test_compression_bench.py)
        parser = own.get(argv[0], cli.build_parser())
        try:
            parser.parse_args(argv[1:] if argv[0] in own else argv)
        except SystemExit:
            raise AssertionError(f"{where}: python -m zipage_jax.bench {' '.join(argv)}") from None
