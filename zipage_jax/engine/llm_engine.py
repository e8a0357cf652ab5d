"""LLMEngine (add_request / step / abort_request), shaped like vLLM's.

One ``step()``: schedule on the host → dispatch the jitted step(s) without waiting → read back the previous
step's sampled tokens → accept them, check stops (``stopping.check_stop``), free finished requests → return
what changed. This is the only step loop: the benchmarks drive it with random weights and the scheduler's
property tests with a fake device (any ``runner.Runner``). The engine is single-threaded by design; ``serve``
drives it from one loop thread.
"""

import collections
import dataclasses
import itertools
import logging
import pathlib
import time

import jax
import jax.numpy as jnp

from zipage_jax import parallel
from zipage_jax.config import DEFAULT_MODEL, EngineConfig
from zipage_jax.core.page_manager import PageManager
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.core.scheduler import Scheduler
from zipage_jax.core.stopping import check_stop
from zipage_jax.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from zipage_jax.engine.metrics import MetricsHistory, StepRecord
from zipage_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from zipage_jax.engine.tokenizer_store import StoredTokenizer, start_engine_tokenizer
from zipage_jax.layers.attention import resolve_backend, sharded
from zipage_jax.models import hub, weights
from zipage_jax.models.config import ModelConfig
from zipage_jax.sampling_params import SamplingParams, completion_budget
from zipage_jax.worker import device_memory, device_state, kv_cache
from zipage_jax.worker.compile_counter import CompileCounter
from zipage_jax.worker.model_runner import ModelRunner, Runner

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one will do


def resolve_dtype(name: str, model_cfg: ModelConfig):
    if name == "auto":
        name = model_cfg.dtype if model_cfg.dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return jnp.dtype(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig | None = None, params=None, *,
                 scheduler: Scheduler | None = None, runner: Runner | None = None):
        """``LLMEngine(config)`` serves the checkpoint ``config.model`` (its config, tokenizer and weights): a
        directory, or a Hugging Face Hub id downloaded into the Hub cache (``models.hub``).

        ``model_cfg`` and ``params``: serve these weights instead (``Params``, or ``ServingParams`` already in the
        serving layout), without a tokenizer (token-id prompts, no text), as the benchmarks do with random
        weights of real model shapes. ``params`` may be a function of no arguments that makes them: it is called
        once the KV pool is placed, which then meets an allocator that no freed weights fragmented (a pool's
        second 25 GiB block found no room on an 80 GB H100 among a conversion's freed buffers).

        ``scheduler`` and ``runner``: step these instead of building them, as the scheduler's property tests do
        with a fake device; the config then supplies only the loop's own fields (``max_model_len``, ``seed``,
        ``metrics_interval_steps``).
        """
        self.config = config
        # where LLM(...)'s seconds go, phase by phase (``bench startup`` prints them)
        self.startup_s: dict[str, float] = {}
        mark = time.perf_counter()
        with device_memory.start_backend(config.gpu_memory_utilization) as self.allocator:
            parallel.join_processes(config)  # before any device query: the backend starts at the block's end
        jax.devices()  # the backend's start (CUDA, the client), timed apart
        self.startup_s["backend"], mark = time.perf_counter() - mark, time.perf_counter()
        local = pathlib.Path(config.model).expanduser()
        self.model_name = local.name if local.is_dir() else config.model  # the id the server offers (a Hub id whole)
        self.model_path = config.model  # where the files are (a Hub id's snapshot)
        self.tokenizer_path = self._tokenizer = self._tokenizer_loading = self._transformers_tokenizer = None
        self.tokenizer_wait_s = 0.0  # how long the start waited for the tokenizer (it loads beside the rest)
        if model_cfg is None and runner is None:
            self.model_path = hub.local_dir(config.model)
            self.tokenizer_path = hub.local_dir(config.tokenizer, "tokenizer") if config.tokenizer else self.model_path
            if not any((pathlib.Path(self.tokenizer_path) / name).is_file() for name in TOKENIZER_FILES):
                field = "tokenizer" if config.tokenizer else "model"
                raise ValueError(f"{field}: no tokenizer in {self.tokenizer_path} (none of {', '.join(TOKENIZER_FILES)}"
                                 f"){'' if config.tokenizer else '; name one with tokenizer'}")
            self._tokenizer_loading = start_engine_tokenizer(self.tokenizer_path, config.compilation_cache_dir)
            model_cfg = ModelConfig.from_pretrained(self.model_path)
        self.model_cfg = model_cfg
        self.startup_s["config"] = time.perf_counter() - mark
        eos = set()
        if model_cfg is not None:
            eos.update(model_cfg.eos_token_ids)
            limit = model_cfg.max_position_embeddings
            if config.max_model_len is not None and config.max_model_len > limit:
                raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's context of {limit}")
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        self.eos_token_ids = tuple(sorted(eos))
        self.memory_plan = None
        if runner is None:
            runner, scheduler = self._build_device_side(params)
        self.runner = runner
        self.scheduler = scheduler
        self.page_manager = scheduler.page_manager
        self.num_pages = self.page_manager.num_pages
        self.compile_counter = CompileCounter()
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._token_texts: dict[int, str] = {}
        self._in_flight = []
        self._aborted: list[Request] = []
        self._arrivals = itertools.count()
        self._seeds = itertools.count(config.seed * 1_000_003 + 1)
        self._rates = collections.deque()  # (time, prefill tokens, decode tokens)
        self.totals = collections.Counter()
        self.history = MetricsHistory(config.metrics_interval_steps)
        self._step_observers: list = []
        self._limited = False  # whether the runner may still limit the steps (``warmup(ready_early=True)``)

    @property
    def tokenizer(self):
        """The tokenizer the engine encodes and decodes with (None where it serves token ids only). It loads
        beside the rest of the start (``tokenizer_store.start_engine_tokenizer``); the first use waits for it and
        adds its end-of-sequence token to the engine's."""
        if self._tokenizer_loading is not None:
            mark = time.perf_counter()
            tokenizer = self._tokenizer_loading()
            self.tokenizer_wait_s = time.perf_counter() - mark
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_token_ids:
                self.eos_token_ids = tuple(sorted({*self.eos_token_ids, tokenizer.eos_token_id}))
                self.runner.eos_token_ids = self.eos_token_ids
            self._tokenizer, self._tokenizer_loading = tokenizer, None
        return self._tokenizer

    def get_tokenizer(self):
        """transformers' tokenizer (chat templates and the rest of its API). The engine's own ``tokenizer`` may be
        the stored Rust pipeline of a warm start (``tokenizer_store``); this loads transformers' on first use."""
        if not isinstance(self.tokenizer, StoredTokenizer):
            return self.tokenizer
        if self._transformers_tokenizer is None:
            self._transformers_tokenizer = load_tokenizer(self.tokenizer_path)
        return self._transformers_tokenizer

    def _build_device_side(self, params) -> tuple[ModelRunner, Scheduler]:
        """Weights on the devices, the memory plan, the runner over its donated state, the scheduler."""
        config, model_cfg = self.config, self.model_cfg
        self.dtype = resolve_dtype(config.dtype, model_cfg)
        self.mesh = parallel.make_mesh(config.tensor_parallel_size, model_cfg)
        backend = resolve_backend(config.attention_backend)
        if config.tensor_parallel_size > 1:
            backend = sharded(backend, self.mesh)
        device = jax.local_devices()[0]

        def plan(weights_bytes):
            return kv_cache.plan_memory(config, model_cfg, self.dtype, self.max_model_len, backend,
                                        allocator=self.allocator, weights_bytes=weights_bytes)

        state = None
        start = time.perf_counter()
        if params is None or callable(params):
            # The pool first, while the allocator is empty: its two largest blocks then cannot meet memory that
            # the weight load fragmented (an 80 GB H100 failed to place the second 25.7 GiB pool after it).
            self.memory_plan = plan(weights.device_bytes(model_cfg, self.dtype, self.mesh, device))
            state = device_state.allocate(config, model_cfg, self.memory_plan.num_pages,
                                          self.memory_plan.num_query_rows, self.dtype, self.mesh)
            jax.block_until_ready(state)
            self.startup_s["plan_and_pool"] = time.perf_counter() - start
            start = time.perf_counter()
            if params is None:
                self.params = weights.load_sharded(self.model_path, model_cfg, self.dtype, self.mesh)  # the shards
            else:
                self.params = weights.shard_params(params(), self.mesh)
        else:
            self.params = weights.shard_params(params, self.mesh)
        jax.block_until_ready(self.params)
        self.startup_s["weights"] = time.perf_counter() - start  # read, copied to the devices, converted there
        if state is None:
            self.memory_plan = plan(device_memory.bytes_on(device, self.params))
        z = self.memory_plan
        num_pages = z.num_pages
        start = time.perf_counter()
        runner = ModelRunner(config, model_cfg, z, self.params, backend, self.mesh, self.eos_token_ids,
                             progress=log_compile, state=state)
        self.startup_s["runner"] = time.perf_counter() - start
        page_manager = PageManager(num_pages, config.page_size, config.enable_prefix_caching)
        log.info("memory plan: %s", z.describe())
        return runner, Scheduler(page_manager, config, z)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model or DEFAULT_MODEL, **kwargs))

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    reject_over_length: bool = False):
        """Queue a request. Bad input raises ``ValueError`` and changes nothing. A ``max_tokens`` beyond what the
        prompt leaves of ``max_model_len`` is capped, as vLLM's offline API does, or, with ``reject_over_length``
        (the server's rule), a ``ValueError`` naming ``max_tokens`` (``completion_budget``); ``max_tokens=None``
        fills the context. The request as queued (its prompt ids after truncation, its ``max_tokens``) is
        ``requests[request_id]``."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if text is not None and self.tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; pass token ids")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if text is not None else list(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:  # vLLM's truncation: the prompt's last tokens
            ids = ids[-keep:]
            text = self.tokenizer.decode(ids) if text is not None else None
        if not ids:
            raise ValueError("prompt: empty prompt")
        if not all(isinstance(t, int) and 0 <= t < self.model_cfg.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {self.model_cfg.vocab_size})")
        max_tokens = completion_budget(len(ids), params.max_tokens, self.max_model_len, reject=reject_over_length)
        self._check_budget(params)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        seed = params.seed if params.seed is not None else next(self._seeds)
        self.add(Request(request_id, ids, params, next(self._arrivals), prompt=text, seed=seed))

    def add(self, request: Request):
        """Queue a request built by the caller, unchecked (``add_request`` validates its input first)."""
        request.arrival_time = time.perf_counter()
        self.requests[request.request_id] = request
        params = request.sampling_params
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                params.spaces_between_special_tokens)
        if params.logprobs is not None:
            request.sample_logprobs = []
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self.scheduler.add(request)

    def _check_budget(self, params: SamplingParams):
        """A per-request KV budget must be usable: compression on, and room for the protected window and sinks."""
        budget = params.kv_budget_pages
        if budget is None:
            return
        config = self.config
        if not config.compression:
            raise ValueError("kv_budget_pages: the engine runs with compression off (start it with compression=True)")
        if budget * config.page_size < config.scoring.window + config.scoring.sink_tokens:
            raise ValueError(f"kv_budget_pages: {budget} pages of {config.page_size} tokens cannot hold the "
                             f"protected window ({config.scoring.window}) and sinks ({config.scoring.sink_tokens})")
        if budget + 1 > self.num_pages - 1:
            raise ValueError(f"kv_budget_pages: {budget} + 1 pages exceed the pool of {self.num_pages - 1}")

    def abort_request(self, request_id: str):
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether stepping has anything to do (parked requests wait for ``resume`` and do not count)."""
        return bool(self.scheduler.has_work() or self._in_flight or self._aborted)

    def park(self, request_ids):
        """Take running requests out of scheduling without freeing anything: each keeps its pages, KV and rows
        (and is never preempted) until ``resume``; a token already in flight is still read back. A benchmark
        holds prefilled requests this way until their batch decodes; a server could pause a client. Raises
        ``ValueError`` (and parks none) unless every id is a running request."""
        for request in self._requests_in(request_ids, RequestStatus.RUNNING):
            self.scheduler.park(request)

    def resume(self, request_ids):
        """Schedule parked requests again, in the order given, after the running ones."""
        for request in self._requests_in(request_ids, RequestStatus.PARKED):
            self.scheduler.resume(request)

    def _requests_in(self, request_ids, status: RequestStatus) -> list[Request]:
        requests = [self.requests.get(request_id) for request_id in request_ids]
        wrong = [i for i, r in zip(request_ids, requests) if r is None or r.status is not status]
        if wrong:
            raise ValueError(f"request_ids: {wrong} are not {status.value} requests")
        return requests

    # -- the loop --------------------------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that advanced (or, with ``only_finished``, that ended:
        offline batches skip building cumulative outputs, which costs O(length) per request and step)."""
        start = time.perf_counter()
        if self._limited:  # a ready-early warm-up still compiles: steps stay within the compiled buckets
            limits = self.runner.limits()
            self.scheduler.limit(limits)
            self._limited = limits is not None
        scheduled = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        handles = self.runner.execute(scheduled)
        dispatched_at = time.perf_counter()
        self.totals["compressions"] += len(scheduled.compressions)
        for handle in handles:
            for request in handle.requests:
                if request is not None:
                    request.add_pending()
        changed, read_back_s = self._collect(handles)
        self.totals["steps"] += 1
        self.history.maybe_sample(self)
        outputs = [self._output(r) for r in changed.values() if r.status.finished or not only_finished]
        if self._step_observers:
            record = StepRecord(scheduled, schedule_s=scheduled_at - start, dispatch_s=dispatched_at - scheduled_at,
                                read_back_s=read_back_s, step_s=time.perf_counter() - start)
            for observer in list(self._step_observers):
                observer(record)
        return outputs

    def drain(self, only_finished: bool = False) -> list[RequestOutput]:
        """Read back the steps in flight without scheduling or dispatching anything: afterwards every token
        sampled so far is known on the host. Returns the outputs that changed, as ``step`` does."""
        changed, _ = self._collect([])
        return [self._output(r) for r in changed.values() if r.status.finished or not only_finished]

    def _collect(self, handles) -> tuple[dict[str, Request], float]:
        """Read back the steps in flight (``handles`` are in flight next); returns the requests that changed and the
        seconds spent waiting for their results."""
        changed, read_back_s = self._read_back(self._in_flight)
        self._in_flight = handles
        for request in self._aborted:
            changed[request.request_id] = request
        self._aborted = []
        for request in changed.values():
            if request.status.finished:
                request.drop_pending()
        return changed, read_back_s

    def _read_back(self, handles) -> tuple[dict[str, Request], float]:
        changed, waited = {}, 0.0
        for handle in handles:
            start = time.perf_counter()
            for part in handle.prompt_logprobs:
                ids, values = part.result()
                for row, (request, position) in enumerate(zip(part.requests, part.positions)):
                    if not request.status.finished:
                        request.prompt_logprobs[position] = self._logprob_dict(
                            ids[row], values[row], request.sampling_params.prompt_logprobs)
            ids, values = handle.result()
            now = time.perf_counter()
            waited += now - start
            self._count(now, handle)
            for row, request in enumerate(handle.requests):
                if request is None or request.status.finished:
                    continue
                self._accept(request, ids[row], values[row])
                changed[request.request_id] = request
        return changed, waited

    def _logprob_dict(self, ids, values, num_top: int) -> dict:
        """{token: Logprob} of one row of the device's logprob layout (``layers.logprobs``): the row's token
        first, then its ``num_top`` most likely tokens in rank order."""
        token = int(ids[0])
        out = {token: Logprob(float(values[0]), int(ids[1]), self._token_text(token))}
        for j in range(num_top):
            top = int(ids[2 + j])
            if top not in out:
                out[top] = Logprob(float(values[1 + j]), j + 1, self._token_text(top))
        return out

    def _token_text(self, token: int) -> str | None:
        """One token's own text (special tokens included), as logprobs show it; memoized per engine."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _count(self, now: float, handle):
        key = "prefill_tokens" if handle.kind == "prefill" else "decode_tokens"
        self.totals[key] += handle.num_tokens
        self._rates.append((now, handle.num_tokens if handle.kind == "prefill" else 0,
                            handle.num_tokens if handle.kind == "decode" else 0))
        while self._rates and now - self._rates[0][0] > RATE_WINDOW_S:
            self._rates.popleft()

    def _accept(self, request: Request, ids, values):
        """Resolve the oldest pending token with the sampled one (a row of the device's logprob layout), then check
        every stop condition."""
        token = int(ids[0])
        num_out = request.resolve_pending(token, float(values[0]))
        params = request.sampling_params
        if request.sample_logprobs is not None:
            request.sample_logprobs.append(self._logprob_dict(ids, values, params.logprobs))
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        self.page_manager.register_full_pages(request)
        before = request.output_text
        if params.stop:  # stop strings need the text now; otherwise it is decoded when an output is built
            self._detokenize(request)
        stop = check_stop(params, self.eos_token_ids, token, num_out, request.output_text, len(before))
        if stop is not None:
            request.stop_reason = stop.reason
            if stop.text_end is not None:
                request.output_text = request.output_text[:stop.text_end]
                self._detokenizers[request.request_id].text = request.output_text
                request.text_complete = True
            elif stop.reason is not None and not params.include_stop_str_in_output:
                # a stop token's own text is left out (vLLM): the text before it
                if params.stop:
                    request.output_text = before
                else:
                    self._detokenize(request, num_out - 1)
                request.text_complete = True
            request.drop_pending()
            self.scheduler.finish(request, stop.status)
            self.totals["finished"] += 1

    def _detokenize(self, request: Request, resolved: int | None = None):
        """Bring the request's text up to its first ``resolved`` tokens (default: all resolved ones; in one batch
        when it lags)."""
        detok = self._detokenizers.get(request.request_id)
        if detok is None:
            return
        resolved = len(request.output_logprobs) if resolved is None else resolved
        if detok.num_added < resolved:
            detok.extend(request.output_token_ids[detok.num_added:resolved])
        request.output_text = detok.text

    def _output(self, request: Request) -> RequestOutput:
        if not request.text_complete:  # a stop string or stop token may have fixed the text already
            self._detokenize(request)
        ids = request.output_token_ids[:len(request.output_logprobs)]  # resolved tokens come first
        want_logprobs = request.sample_logprobs is not None
        completion = CompletionOutput(
            index=0, text=request.output_text, token_ids=ids,
            cumulative_logprob=float(sum(request.output_logprobs)) if want_logprobs else None,
            logprobs=list(request.sample_logprobs) if want_logprobs else None,
            finish_reason=request.status.value if request.status.finished else None,
            stop_reason=request.stop_reason)
        if request.status.finished:
            self.requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
        prompt_logprobs = None if request.prompt_logprobs is None else list(request.prompt_logprobs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.status.finished, self._request_metrics(request), prompt_logprobs)

    @staticmethod
    def _request_metrics(request: Request) -> dict:
        return dict(peak_kv_pages=request.peak_pages, num_cached_tokens=request.num_cached_tokens,
                    num_preemptions=request.num_preemptions, num_compressions=request.num_compressions,
                    peak_kv_pages_after_compression=request.peak_pages_after_compression,
                    time_to_first_token=(request.first_token_time - request.arrival_time
                                         if request.first_token_time else None))

    # -- observability ---------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        span = (self._rates[-1][0] - self._rates[0][0]) if len(self._rates) > 1 else 0.0
        prefill = sum(r[1] for r in self._rates)
        decode = sum(r[2] for r in self._rates)
        bm = self.page_manager
        return dict(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preempted=self.scheduler.num_preemptions,
            kv_pages_total=bm.num_pages - 1, kv_pages_used=bm.num_used_pages,
            page_occupancy=bm.num_used_pages / (bm.num_pages - 1),
            prefix_cache_hit_rate=bm.hit_rate(),
            prompt_tokens_total=self.totals["prefill_tokens"], generation_tokens_total=self.totals["decode_tokens"],
            prefill_tokens_per_s=prefill / span if span else 0.0,
            decode_tokens_per_s=decode / span if span else 0.0,
            compression_time_share=self.history.compression_share(self),
            steady_compression_time_share=self.history.steady_compression_share(self),
            num_requests_finished=self.totals["finished"],
            num_compressions=self.totals["compressions"],
            num_compiles=self.compile_counter.count,
            num_compiles_waited_on=self.runner.programs.compiled_on_use,  # by a step: warm-up missed a bucket
            compiling_in_background=self.compiling_in_background,
            num_stalled=self.scheduler.num_stalled, num_swapped=len(self.scheduler.swapped),
            num_swaps=self.scheduler.num_swaps,
            num_query_rows=self.scheduler.num_query_rows,
            query_rows_used=self.scheduler.num_query_rows - len(self.scheduler.free_query_rows),
            max_concurrency=self.memory_plan.max_concurrency,
        )

    @property
    def compiling_unused(self) -> bool:
        """Whether compiles nobody waits for still run (a stopped warm-up's): a process exiting now would wait for
        them (``core_client.exit_if_compiling``)."""
        return self.runner.programs.compiling_unused

    @property
    def compiling_in_background(self) -> bool:
        """Whether a ready-early warm-up's background compiles still limit the steps."""
        return self._limited and self.runner.limits() is not None

    def metrics_history(self) -> list[dict]:
        """Samples of the scheduler state every ``metrics_interval_steps`` steps (oldest first, bounded)."""
        return list(self.history.samples)

    def reset_metrics_history(self):
        """Start the metrics history and the time shares of ``metrics()`` afresh from now (a benchmark's
        workload after its warm-up): earlier samples are dropped, rates and shares count from here."""
        self.history.reset(self)

    def add_step_observer(self, observer):
        """Call ``observer(StepRecord)`` after every ``step``: what the scheduler decided and where the step's host
        time went (benchmarks time steps this way; a server could log slow ones)."""
        self._step_observers.append(observer)

    def remove_step_observer(self, observer):
        self._step_observers.remove(observer)

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile every shape bucket now (in parallel), so no request waits on a compile later.

        Each compile is logged; ``progress(done, total, name, seconds)``, if given, is called too (a progress bar,
        the server's health state). Returns the number of programs and the wall seconds compiling them took.
        ``stop``: a ``concurrent.futures.Future`` whose completion ends the warm-up at once (``CompileStopped``;
        what was not compiled compiles on first use), as the server does when it is asked to shut down.

        ``ready_early``: return once the programs of a light load are ready (the smallest decode batch, prefill
        chunk and compression of each kind) and compile the rest in the background (``background`` in the
        report: how many); until they are, steps take no more requests and prompt tokens than the compiled
        programs cover, so no request waits on a compile — requests beyond wait in the queue instead."""
        def logged(*args):
            log_compile(*args)
            if progress is not None:
                progress(*args)

        report = self.runner.warmup(logged, stop, ready_early=ready_early)
        self.tokenizer  # noqa: B018 (ready means ready for text too: waits for the tokenizer, if still loading)
        self._limited = ready_early and bool(report.get("background"))
        self.history.mark_steady(self)
        log.info("warm-up: %d programs ready in %.1fs (%d loaded from the executable store in %.1fs; tracing %.1fs, "
                 "compiling %.1fs summed over the parallel compiles)", report["programs"], report["compile_s"],
                 report.get("loaded", 0), report.get("load_s", 0.0), report.get("lower_s", 0.0),
                 report.get("compile_sum_s", 0.0))
        if report.get("background"):
            log.info("serving now; %d more programs compile in the background", report["background"])
        return report


def log_compile(done: int, total: int, name: str, seconds: float):
    log.info("compiling %d/%d: %s (%.1fs)", done, total, name, seconds)
