"""Online serving benchmark: drive a running ``zipage_jax.serve`` over HTTP, like vLLM's serving benchmark.

    python -m zipage_jax.serve --compression ... &                    # the server under test
    python -m zipage_jax.bench serving --url http://127.0.0.1:8000 --rates 1 2 4 --requests 64 --json out.json
    python -m zipage_jax.bench serving --url ... --soak 300 --soak-rate 2 --cancel-prob 0.3 --server-pid PID

Rates: for each request rate (requests/s), the workload's requests arrive as a Poisson process, each a streamed
``/v1/completions`` call (token-id prompt, ``ignore_eos``, its own ``max_tokens``). Per rate: time to first token
(TTFT), inter-token latency (ITL: the gaps between streamed chunks, each one token unless the server coalesced
several), time per output token after the first (TPOT) and end-to-end latency, as mean and p50/p90/p99; request
and output-token throughput; goodput: requests per second that met both SLOs (``--slo-ttft``, ``--slo-tpot``).

Soak: requests at ``--soak-rate`` for ``--soak`` seconds, each cancelled by its client (the stream closed) with
probability ``--cancel-prob`` after a random number of chunks. ``/metrics`` is sampled throughout; when the load
stops and the server drains, the KV pages in use must return to their value before the load, and the server's
resident memory (``--server-pid``, same machine) must stay flat: its growth over the second half of the soak is
reported and checked against ``--rss-tolerance-mb``.
"""

import asyncio
import collections
import json
import time

import numpy as np

from zipage_jax.benchmarks.workloads import WORKLOADS, make_workload
from zipage_jax.config import DEFAULT_MODEL, add_engine_options, engine_kwargs

PERCENTILES = (50, 90, 99)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to ``{name: value}`` of the samples without labels of their own (the engine's ``model_name``
    and ``engine`` set aside)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if not set(sample.labels) - {"model_name", "engine"}}


def server_rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def distribution(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return dict(mean=None, **{f"p{p}": None for p in PERCENTILES})
    return dict(mean=float(np.mean(values)), **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})


async def one_request(client, url: str, model: str, prompt, max_tokens: int, cancel_after: int | None) -> dict:
    """One streamed completion; times its chunks. ``cancel_after``: close the stream after that many chunks."""
    import httpx

    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, ignore_eos=True, temperature=0.0,
                stream_options=dict(include_usage=True))
    start = time.perf_counter()
    chunks, tokens, error, cancelled = [], None, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    message = json.loads(data)
                    if "error" in message:
                        error = str(message["error"])
                        break
                    if message.get("usage"):
                        tokens = message["usage"]["completion_tokens"]
                    if message.get("choices"):
                        chunks.append(time.perf_counter())
                        if cancel_after is not None and len(chunks) >= cancel_after:
                            cancelled = True
                            break
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    ttft = chunks[0] - start if chunks else None
    done = error is None and not cancelled
    tpot = (end - chunks[0]) / (tokens - 1) if done and chunks and tokens and tokens > 1 else None
    return dict(start=start, ttft=ttft, e2e=end - start if done else None, itl=np.diff(chunks).tolist(),
                tpot=tpot, tokens=tokens, chunks=len(chunks), max_tokens=max_tokens, error=error, cancelled=cancelled)


async def drive(url: str, model: str, prompts, max_tokens, rate: float, seed: int, cancel_prob: float = 0.0,
                until_s: float | None = None, on_tick=None) -> tuple[list[dict], float]:
    """Poisson arrivals at ``rate``; with ``until_s``, arrivals cycle through the requests until then.
    ``on_tick()`` is awaited about once a second while requests run. Returns (per-request results, wall s)."""
    import httpx

    rng = np.random.default_rng(seed)
    tasks = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        next_at, i, last_tick = 0.0, 0, 0.0
        while (until_s is None and i < len(prompts)) or (until_s is not None and next_at < until_s):
            now = time.perf_counter() - start
            if on_tick and now - last_tick >= 1.0:
                last_tick = now
                await on_tick()
            if now < next_at:
                await asyncio.sleep(min(next_at - now, 1.0))
                continue
            k = i % len(prompts)
            cancel = int(rng.integers(1, max(2, max_tokens[k] // 2))) if rng.random() < cancel_prob else None
            tasks.append(asyncio.create_task(one_request(client, url, model, prompts[k], max_tokens[k], cancel)))
            i += 1
            next_at += rng.exponential(1.0 / rate)
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if on_tick:
                await on_tick()
        return [t.result() for t in tasks], time.perf_counter() - start


async def drive_closed(url: str, model: str, prompts, max_tokens, concurrency: int) -> tuple[list[dict], float]:
    """Closed loop, as vLLM's benchmark runs with ``--max-concurrency``: ``concurrency`` streams, each sending the
    next request as soon as its last one ends, until every request has run. Returns (results, wall s)."""
    import httpx

    queue = iter(range(len(prompts)))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def stream():
            for k in queue:  # one shared iterator: each request runs once
                results.append(await one_request(client, url, model, prompts[k], max_tokens[k], None))

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(prompts)))))
        return results, time.perf_counter() - start


def offline(workload, engine_options: dict, concurrency: int) -> dict:
    """The same requests through the in-process engine (``LLMEngine``, warmed up first), at most ``concurrency``
    unfinished at a time as the closed-loop clients keep them: the server's ceiling, without HTTP, SSE or
    detokenization. Output tokens per second from the first request to the last token."""
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.sampling_params import SamplingParams

    engine = LLMEngine.from_kwargs(**engine_options)
    engine.warmup()
    compiles = engine.metrics()["num_compiles"]
    pending = collections.deque(zip(workload.prompts, workload.max_tokens))
    running, done, tokens, next_id = set(), 0, 0, 0
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < concurrency:
            prompt, max_tokens = pending.popleft()
            engine.add_request(f"offline-{next_id}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            running.add(f"offline-{next_id}")
            next_id += 1
        for out in engine.step(only_finished=True):
            running.discard(out.request_id)
            done += 1
            tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return dict(concurrency=concurrency, requests=done, output_tokens=tokens, wall_s=wall,
                output_tokens_per_s=tokens / wall,
                compiles_after_warmup=engine.metrics()["num_compiles"] - compiles)


def summarize(results: list[dict], wall: float, rate: float | None, slo_ttft: float, slo_tpot: float) -> dict:
    done = [r for r in results if r["e2e"] is not None]
    good = [r for r in done if r["ttft"] <= slo_ttft and (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    output = sum(r["tokens"] or 0 for r in done)
    return dict(rate=rate, requests=len(results), completed=len(done),
                cancelled=sum(r["cancelled"] for r in results), errors=sum(r["error"] is not None for r in results),
                error_examples=[r["error"] for r in results if r["error"]][:3], wall_s=wall,
                request_throughput=len(done) / wall, output_tokens_per_s=output / wall, goodput=len(good) / wall,
                goodput_fraction=len(good) / max(len(done), 1),
                ttft_s=distribution(r["ttft"] for r in done), tpot_s=distribution(r["tpot"] for r in done),
                itl_s=distribution(x for r in done for x in r["itl"]), e2e_s=distribution(r["e2e"] for r in done))


async def fetch_metrics(url: str) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        return parse_metrics((await client.get(f"{url}/metrics")).text)


async def served_model(url: str) -> dict:
    """The server's model card: its ``id`` and ``max_model_len``."""
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        return (await client.get(f"{url}/v1/models")).json()["data"][0]


async def soak(url: str, model: str, prompts, max_tokens, args) -> dict:
    """Load with cancellations for ``args.soak`` seconds; pages back to baseline and flat memory after it."""
    baseline = await fetch_metrics(url)
    samples, start = [], time.perf_counter()

    async def tick():
        m = await fetch_metrics(url)
        samples.append(dict(time_s=time.perf_counter() - start, kv_pages_used=m.get("zipage:kv_pages_used"),
                            running=m.get("vllm:num_requests_running"), waiting=m.get("vllm:num_requests_waiting"),
                            rss_bytes=server_rss_bytes(args.server_pid) if args.server_pid else None))

    results, wall = await drive(url, model, prompts, max_tokens, args.soak_rate, args.seed + 1, args.cancel_prob,
                                until_s=args.soak, on_tick=tick)
    deadline = time.perf_counter() + args.drain_timeout  # the server aborts cancelled requests on its next steps
    while True:
        after = await fetch_metrics(url)
        idle = after.get("vllm:num_requests_running", 0) == 0 and after.get("vllm:num_requests_waiting", 0) == 0
        if (idle and after.get("zipage:kv_pages_used") == baseline.get("zipage:kv_pages_used")) \
                or time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.2)
    await tick()
    rss = [s["rss_bytes"] for s in samples if s["rss_bytes"] is not None]
    half = rss[len(rss) // 2:] if rss else []
    growth = (max(half) - half[0]) / 1e6 if len(half) > 1 else None
    aborts = "zipage:server_client_aborts_total"
    return dict(soak_s=args.soak, rate=args.soak_rate, cancel_prob=args.cancel_prob,
                summary=summarize(results, wall, args.soak_rate, args.slo_ttft, args.slo_tpot),
                kv_pages_used_before=baseline.get("zipage:kv_pages_used"),
                kv_pages_used_after=after.get("zipage:kv_pages_used"),
                peak_kv_pages_used=max((s["kv_pages_used"] or 0 for s in samples), default=0),
                pages_returned=after.get("zipage:kv_pages_used") == baseline.get("zipage:kv_pages_used"),
                idle_after=idle, client_aborts=after.get(aborts, 0) - baseline.get(aborts, 0),
                rss_growth_second_half_mb=growth,
                memory_flat=None if growth is None else growth <= args.rss_tolerance_mb, samples=samples)


def add_arguments(parser):
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0], help="requests per second")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[],
                        help="closed-loop runs, as vLLM's --max-concurrency: this many streams, each sending its next "
                             "request when its last one ends, over the workload's requests")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="with --offline: the checkpoint to serve (default: the "
                                                               "shipped model)")
    parser.add_argument("--offline", action="store_true",
                        help="instead of a server: the same requests through the in-process engine built from the "
                             "engine options below, at each --concurrency (the server's ceiling)")
    parser.add_argument("--requests", type=int, default=64, help="requests per rate")
    parser.add_argument("--workload", choices=WORKLOADS, default="reasoning")
    parser.add_argument("--page-size", type=int, default=16,
                        help="the server's page size, which the workload's lengths are counted in")
    parser.add_argument("--budget-tokens", type=int, default=64, help="scales the workload's output lengths")
    parser.add_argument("--vocab-size", type=int, default=128, help="prompt token ids are drawn below this")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output of a request at most (default: the server's, from /v1/models)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on time to first token, seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on time per output token, seconds")
    parser.add_argument("--soak", type=float, help="soak: seconds of load with random client cancellations")
    parser.add_argument("--soak-rate", type=float, default=2.0)
    parser.add_argument("--cancel-prob", type=float, default=0.3)
    parser.add_argument("--server-pid", type=int, help="the server's process id (same machine): its RSS is sampled")
    parser.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.set_defaults(engine_fields=add_engine_options(parser, exclude=("page_size", "max_model_len", "seed")))


def main(args) -> dict:
    for name in ("requests", "soak_rate", "page_size", "budget_tokens", "vocab_size"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name}: must be > 0 (got {getattr(args, name)})")
    if any(r <= 0 for r in args.rates):
        raise ValueError(f"rates: must be > 0 (got {args.rates})")
    if not 0 <= args.cancel_prob <= 1:
        raise ValueError(f"cancel_prob: must be in [0, 1] (got {args.cancel_prob})")
    if any(c <= 0 for c in args.concurrency):
        raise ValueError(f"concurrency: must be > 0 (got {args.concurrency})")
    if args.offline:
        return main_offline(args)
    url = args.url.rstrip("/")
    card = asyncio.run(served_model(url))
    model = card["id"]
    w = make_workload(args.workload, args.requests, args.budget_tokens, args.page_size, args.vocab_size,
                      args.max_model_len or card["max_model_len"], args.seed)
    report = dict(benchmark="serving", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), url=url, model=model,
                  workload=w.summary(), slo=dict(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot), rates=[],
                  concurrency=[], soak=None)

    def write():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    for concurrency in args.concurrency:
        results, wall = asyncio.run(drive_closed(url, model, w.prompts, w.max_tokens, concurrency))
        row = dict(summarize(results, wall, None, args.slo_ttft, args.slo_tpot), concurrency=concurrency)
        report["concurrency"].append(row)
        print(format_rate(row), flush=True)
        write()

    for rate in args.rates:
        results, wall = asyncio.run(drive(url, model, w.prompts, w.max_tokens, rate, args.seed))
        row = summarize(results, wall, rate, args.slo_ttft, args.slo_tpot)
        report["rates"].append(row)
        print(format_rate(row), flush=True)
        write()
    if args.soak:
        report["soak"] = asyncio.run(soak(url, model, w.prompts, w.max_tokens, args))
        s = report["soak"]
        print(f"soak {s['soak_s']:.0f}s at {s['rate']}/s: {s['summary']['requests']} requests, "
              f"{s['summary']['cancelled']} cancelled, {s['client_aborts']:.0f} aborts seen by the server; pages "
              f"{s['kv_pages_used_before']:.0f} -> peak {s['peak_kv_pages_used']:.0f} -> {s['kv_pages_used_after']:.0f} "
              f"(returned: {s['pages_returned']}); RSS growth over the second half "
              f"{s['rss_growth_second_half_mb']} MB (flat: {s['memory_flat']})", flush=True)
        write()
    return report


def main_offline(args) -> dict:
    """``--offline``: the workload through the in-process engine at each ``--concurrency``."""
    if args.max_model_len is None:
        raise ValueError("max_model_len: --offline needs it (a server reports its own)")
    options = dict(engine_kwargs(args, args.engine_fields), model=args.model, page_size=args.page_size, max_model_len=args.max_model_len,
                   seed=args.seed)
    w = make_workload(args.workload, args.requests, args.budget_tokens, args.page_size, args.vocab_size,
                      args.max_model_len, args.seed)
    report = dict(benchmark="serving-offline", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  engine_options=options, workload=w.summary(), concurrency=[])
    for concurrency in args.concurrency or [options.get("max_num_seqs", 256)]:
        row = offline(w, options, concurrency)
        report["concurrency"].append(row)
        print(f"offline, concurrency {concurrency}: {row['requests']} requests, {row['output_tokens_per_s']:.1f} "
              f"output tok/s over {row['wall_s']:.1f}s; {row['compiles_after_warmup']} compiles", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return report


def format_rate(r: dict) -> str:
    def ms(d, key):
        return "-" if d[key] is None else f"{d[key] * 1e3:.0f}"

    load = f"rate {r['rate']:g}/s" if r.get("rate") is not None else f"concurrency {r['concurrency']}"
    return (f"{load}: {r['completed']}/{r['requests']} done, {r['errors']} errors, "
            f"{r['output_tokens_per_s']:.1f} tok/s, goodput {r['goodput']:.2f} req/s | TTFT ms p50/p90/p99 "
            f"{ms(r['ttft_s'], 'p50')}/{ms(r['ttft_s'], 'p90')}/{ms(r['ttft_s'], 'p99')} | ITL "
            f"{ms(r['itl_s'], 'p50')}/{ms(r['itl_s'], 'p90')}/{ms(r['itl_s'], 'p99')} | e2e "
            f"{ms(r['e2e_s'], 'p50')}/{ms(r['e2e_s'], 'p90')}/{ms(r['e2e_s'], 'p99')}")
