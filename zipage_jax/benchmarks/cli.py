"""Engine benchmarks (random weights of real model shapes, or a checkpoint): `python -m zipage_jax.bench NAME`."""

import argparse
import importlib
import json
import sys


from zipage_jax.benchmarks import decode as decode_bench
from zipage_jax.benchmarks import scheduling, serving, throughput
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.benchmarks.startup import startup_benchmark
from zipage_jax.config import add_engine_options, engine_kwargs

# benchmarks with a command line of their own: ``bench NAME ARGS`` hands ARGS to NAME's ``main``
OWN_COMMAND_LINE = {
    "compression": ("zipage_jax.benchmarks.compression", "one compression of a batch of requests against a decode "
                                                         "step: the kernels, the jnp references, scratch memory"),
    "bitmask": ("zipage_jax.benchmarks.bitmask_cost", "device and host cost of structured outputs' token bitmask, "
                                                      "free and half-constrained batches"),
    "concurrency": ("zipage_jax.benchmarks.concurrency", "what bounds compressed and full-KV concurrency on an H100 "
                                                         "and an H200, from the engine's memory plan (no GPU)"),
    "eviction-diagnosis": ("zipage_jax.benchmarks.eviction_diagnosis", "which evicted tokens break the interleaved-"
                                                                       "sums task under a budget"),
    "fp8-scales": ("zipage_jax.benchmarks.fp8_scales", "which FP8 scale scheme the KV pool uses: attention error and "
                                                        "kept-token agreement per scheme (CPU)"),
    "logprobs": ("zipage_jax.benchmarks.logprobs_cost", "device time of the per-step logprobs against a greedy "
                                                        "step's sampling"),
    "prefill-work": ("zipage_jax.benchmarks.prefill_work", "the ragged prefill kernel's work counted from its "
                                                           "tiling (no GPU)"),
    "serve-ready": ("zipage_jax.benchmarks.serve_ready", "seconds from launching the server to its first /health "
                                                         "200, cold and warm"),
    "trig-scores": ("zipage_jax.benchmarks.trig_scores", "what the query-free triattention scores cost against the "
                                                          "other policies' scoring and a decode step"),
    "sweep": ("zipage_jax.benchmarks.sweep", "accuracy over a grid of KV budgets x scoring configurations"),
    "ttft": ("zipage_jax.benchmarks.ttft", "time to first token of one long prompt per attention backend (the "
                                           "prefill kernel before/after)"),
}


def build_parser() -> argparse.ArgumentParser:
    """The benchmarks' command line (those with their own, in ``OWN_COMMAND_LINE``, appear by name only)."""
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (_, help_text) in OWN_COMMAND_LINE.items():
        sub.add_parser(name, help=help_text + f" (python -m zipage_jax.bench {name} --help)", add_help=False)
    decode = sub.add_parser("decode", help="decode throughput of the full-KV engine")
    decode.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    decode.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    decode.add_argument("--ctx", type=int, default=1024, help="prompt tokens prefilled per request")
    decode.add_argument("--steps", type=int, default=64, help="measured decode steps per batch size")
    decode.add_argument("--warmup-steps", type=int, default=3)
    decode.add_argument("--no-hlo", action="store_true", help="skip the compiled-HLO inspection")
    decode.add_argument("--profile", action="store_true",
                        help="trace the device step and record where its time goes (per kernel and category)")
    decode.add_argument("--json", help="write the report here")
    decode.set_defaults(engine_fields=add_engine_options(decode, exclude=decode_bench.SIZED + decode_bench.UNUSED,
                                                         defaults=decode_bench.DEFAULTS))
    scheduling.add_arguments(sub.add_parser("scheduling", help="compressed requests under memory pressure: async vs "
                                                                "sync compression, reserved vs hybrid vs constrained "
                                                                "admission"))
    startup = sub.add_parser("startup", help="LLM(...) + warmup() time, programs, and compiles after warm-up")
    startup.add_argument("--model", required=True, help="HF checkpoint directory")
    startup.add_argument("--workload", type=int, default=24, help="requests of the mixed workload after warm-up")
    startup.add_argument("--json", help="append the report here (one JSON object a line)")
    startup.add_argument("--ready-early", action="store_true",
                         help="ready once a light load's programs are, the rest compiling in the background (as "
                              "`serve` starts); then the workload must wait on no compile")
    startup.set_defaults(engine_fields=add_engine_options(startup))
    throughput.add_arguments(sub.add_parser("throughput", help="compressed vs full-KV engine throughput on a "
                                                                     "named workload (and an HF peer)"))
    serving.add_arguments(sub.add_parser("serving", help="latency and goodput of a running server at given "
                                                               "request rates; soak with client cancellations"))
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_COMMAND_LINE:
        module = importlib.import_module(OWN_COMMAND_LINE[argv[0]][0])
        return module.main(argv[1:]), None
    args = build_parser().parse_args(argv)
    if args.benchmark == "throughput":
        return throughput.main(args), None
    if args.benchmark == "serving":
        return serving.main(args), None
    if args.benchmark == "scheduling":
        return scheduling.main(args)
    if args.benchmark == "startup":
        report = startup_benchmark(args.model, engine_kwargs(args, args.engine_fields), args.workload,
                                   ready_early=args.ready_early)
        r = report
        print(f"LLM() {r['init_s']:.1f}s (weights {r['weights_s']:.1f}s: {r['checkpoint_bytes'] / 1e9:.2f} GB at "
              f"{r['weights_bytes_per_s'] / 1e9:.2f} GB/s, raw parallel read {r['raw_read_bytes_per_s'] / 1e9:.2f} GB/s) "
              f"+ warmup() {r['compile_s']:.1f}s ({r['loaded']}/{r['programs']} programs loaded in {r['load_s']:.1f}s, "
              f"tracing {r['lower_s']:.1f}s, compiling {r['compile_sum_s']:.1f}s summed) = ready in {r['ready_s']:.1f}s; "
              f"first token at {r['first_token_s']:.1f}s; {r['compiles_after_warmup']} compiles "
              f"{'waited on ' if r['ready_early'] else ''}during a mixed workload of {r['workload_requests']} requests")
        if r["ready_early"]:
            print(f"ready early: {r['background_programs']} programs compiled in the background, all ready at "
                  f"{r['all_compiled_s']:.1f}s")
        print("LLM() by phase: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in r["init_phases_s"].items())
              + f"; inside them {r['init_compiles']} compiles ({r['init_compile_s']:.2f}s summed: the pool's fill, the "
                f"weights' conversions, some in parallel); tokenizer: {r['tokenizer']}, waited for "
                f"{r['tokenizer_wait_s']:.1f}s")
        print(r["memory_plan"])
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(report) + "\n")
        return report, None

    def write(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    report, outputs = decode_bench.decode_benchmark(
        args.model_shape, args.batch, args.ctx, args.steps, engine_kwargs(args, args.engine_fields), args.warmup_steps,
        not args.no_hlo, args.profile, progress=lambda line: print(line, flush=True), on_result=write)
    print(decode_bench.HEADER)
    for row in report["results"]:
        print(decode_bench.format_row(row))
    for row in report["results"]:
        if row["profile"]:
            print(decode_bench.format_profile(row))
    if report["hlo"]:
        print("pool-shaped ops in the compiled decode step:", report["hlo"]["ops_producing_pool_shape"],
              "| copies of the pool:", report["hlo"]["pool_copies"], "| collectives:", report["hlo"]["collectives"])
    write(report)
    return report, outputs
