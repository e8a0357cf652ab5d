"""Several processes run one tensor-parallel engine: every process builds the same ``LLM`` (joined through
``coordinator_address`` / ``num_processes`` / ``process_id``) and generates the same batch, and all of them must
give one process's greedy tokens. Two workloads: compression off, and a compressed one under memory pressure
that swaps a request out and back in.

    PYTHONPATH=. python scripts/multi_process_check.py                # 2 CPU processes, one device each (gloo)
    PYTHONPATH=. python scripts/multi_process_check.py --gpu          # 2 processes, one GPU each, on one host

The processes are local, but they meet only through the coordinator and the collectives, as on several hosts.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

MODEL = "tests/fixtures/hf/qwen3_untied"  # 2 KV heads: tensor parallel over up to two devices


def generate(process_id: int | None, num_processes: int, port: int, gpu: bool) -> list:
    import jax

    if not gpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import numpy as np

    from zipage_jax import LLM, SamplingParams

    joined = {}
    if process_id is not None:
        joined = dict(coordinator_address=f"localhost:{port}", num_processes=num_processes, process_id=process_id)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(2, 30, size=3)]
    options = dict(page_size=16, max_num_batched_tokens=128, compilation_cache_dir=None,
                   tensor_parallel_size=num_processes if joined else 1, attention_backend="reference", **joined)
    greedy = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    plain = LLM(MODEL, max_num_seqs=4, max_model_len=128, **options)
    tokens = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    # a small pool: the large-budget request runs out of pages and the compressed tail is swapped out and back
    tight = LLM(MODEL, compression=True, kv_budget_pages=1, window=4, num_gpu_pages_override=8, max_model_len=112,
                max_num_seqs=3, num_query_rows=2, **options)
    budgets = [SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True, kv_budget_pages=b) for b in (3, 1, 1)]
    short = [p[:5] for p in prompts]
    tokens += [o.outputs[0].token_ids for o in tight.generate(short, budgets, use_tqdm=False)]
    return dict(tokens=tokens, swaps=tight.metrics()["num_swaps"], processes=jax.process_count(),
                devices=len(jax.devices()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per process (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # a child: -1 = the single process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        rank = None if args.process_id < 0 else args.process_id
        print(json.dumps(generate(rank, args.num_processes, args.port, args.gpu)))
        return
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(-1, args.num_processes):
        env = dict(os.environ)
        if args.gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(max(rank, 0))
        else:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
        command = [sys.executable, __file__, "--num-processes", str(args.num_processes), "--process-id", str(rank),
                   "--port", str(port)] + (["--gpu"] if args.gpu else [])
        children.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, child in zip(range(-1, args.num_processes), children):
        out, err = child.communicate(timeout=600)
        if child.returncode:
            sys.exit(f"process {rank} failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    single, joined = results[0], results[1:]
    same = all(r["tokens"] == single["tokens"] for r in joined)
    print(f"{args.num_processes} processes x 1 device, tensor parallel over {joined[0]['devices']} devices: "
          f"greedy tokens {'equal to' if same else 'DIFFERENT from'} one process's "
          f"({len(single['tokens'])} requests, {joined[0]['swaps']} swap(s) in the compressed run)")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
