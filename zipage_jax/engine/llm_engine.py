"""LLMEngine (add_request / step / abort_request), shaped like vLLM's.

One ``step()``: schedule on the host → dispatch the jitted step(s) without waiting (``worker.execute``) → read back
the previous step's sampled tokens → the scheduler accepts them, the output processor checks stops, finished
requests are freed → return what changed. This is the only step loop: the benchmarks drive it with random weights
and the scheduler's property tests with a fake device (any ``worker.Executor``). The engine is single-threaded by
design; ``serve`` drives it from one loop thread.
"""

import collections
import itertools
import logging
import pathlib
import time

from zipage_jax.config import DEFAULT_MODEL, EngineConfig
from zipage_jax.core.page_manager import PageManager
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.core.scheduler import Scheduler
from zipage_jax.engine.detokenizer import load_tokenizer
from zipage_jax.engine.input_processor import InputProcessor
from zipage_jax.engine.metrics import EngineStats, Meter, StepRecord
from zipage_jax.engine.output_processor import OutputProcessor
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.tokenizer_store import StoredTokenizer, start_engine_tokenizer
from zipage_jax.models import hub
from zipage_jax.models.config import ModelConfig
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.structured_output.manager import StructuredOutputManager
from zipage_jax.worker.compile_counter import CompileCounter
from zipage_jax.worker.worker import Executor, Worker

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one will do


class LLMEngine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig | None = None, params=None, *,
                 worker: Executor | None = None, scheduler: Scheduler | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler):
        """``LLMEngine(config)`` serves the checkpoint ``config.model`` (its config, tokenizer and weights): a
        directory, or a Hugging Face Hub id downloaded into the Hub cache (``models.hub``).

        ``model_cfg`` and ``params``: serve these weights instead (``Params``, or ``ServingParams`` already in the
        serving layout), without a tokenizer (token-id prompts, no text), as the benchmarks do with random
        weights of real model shapes. ``params`` may be a function of no arguments that makes them: it is called
        once the KV pool is placed, which then meets an allocator that no freed weights fragmented.

        ``worker`` (with ``model_cfg``): step this device side instead of bringing one up (a benchmark inspecting
        its programs; the scheduler's property tests bring a fake one). ``scheduler_cls``: schedule with this
        ``Scheduler`` subclass (a benchmark's holds requests); ``scheduler``: with this one (the config then
        supplies only the loop's own fields: ``max_model_len``, ``seed``, ``metrics_interval_steps``).
        """
        self.config = config
        # where LLM(...)'s seconds go, phase by phase (``bench startup`` prints them)
        self.startup_s: dict[str, float] = {}
        mark = time.perf_counter()
        local = pathlib.Path(config.model).expanduser()
        self.model_name = local.name if local.is_dir() else config.model  # the id the server offers (a Hub id whole)
        self.model_path = config.model  # where the files are (a Hub id's snapshot)
        self.tokenizer_path = self._tokenizer_loading = self._transformers_tokenizer = None
        self.tokenizer_wait_s = 0.0  # how long the start waited for the tokenizer (it loads beside the rest)
        if model_cfg is None:
            self.model_path = hub.local_dir(config.model)
            self.tokenizer_path = tokenizer_dir(config, self.model_path)
            self._tokenizer_loading = start_engine_tokenizer(self.tokenizer_path, config.compilation_cache_dir)
            model_cfg = ModelConfig.from_pretrained(self.model_path)
        self.model_cfg = model_cfg
        self.startup_s["config"] = time.perf_counter() - mark
        self.max_model_len = config.context_length(model_cfg.max_position_embeddings)
        self.eos_token_ids = tuple(sorted(set(model_cfg.eos_token_ids)))
        if worker is None:
            worker = Worker.create(config, model_cfg, params=params, model_path=self.model_path,
                                   eos_token_ids=self.eos_token_ids, progress=log_compile, startup_s=self.startup_s)
        self.worker = worker
        self.memory_plan = worker.plan
        if scheduler is None:
            scheduler = scheduler_cls(PageManager(self.memory_plan.num_pages, config.page_size,
                                                  config.enable_prefix_caching), config, self.memory_plan)
        self.scheduler = scheduler
        self.page_manager = scheduler.page_manager
        self.num_pages = self.page_manager.num_pages
        self.inputs = InputProcessor(config, model_cfg.vocab_size, self.max_model_len, self.num_pages)
        self.outputs = OutputProcessor(None, self.eos_token_ids)
        self.compile_counter = CompileCounter()
        self.requests: dict[str, Request] = {}
        self.meter = Meter(config.metrics_interval_steps)
        self._in_flight = []
        self._aborted: list[Request] = []
        self._arrivals = itertools.count()
        self._seeds = itertools.count(config.seed * 1_000_003 + 1)
        self._step_observers: list = []
        self._limited = False  # whether the worker may still limit the steps (``warmup(ready_early=True)``)
        self._structured: StructuredOutputManager | None = None  # made by the first constrained request

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model or DEFAULT_MODEL, **kwargs))

    # -- the tokenizer ---------------------------------------------------------------------------------------
    def wait_for_tokenizer(self):
        """The tokenizer loads beside the rest of the start (``tokenizer_store.start_engine_tokenizer``); wait for
        it (once) and add its end-of-sequence token to the model's, for the stop checks and ``min_tokens`` bans."""
        if self._tokenizer_loading is None:
            return
        mark = time.perf_counter()
        tokenizer = self._tokenizer_loading()
        self.tokenizer_wait_s = time.perf_counter() - mark
        self._tokenizer_loading = None
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids = tuple(sorted({*self.eos_token_ids, tokenizer.eos_token_id}))
            self.worker.set_eos_token_ids(self.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)

    @property
    def tokenizer(self):
        """The tokenizer the engine encodes and decodes with (None where it serves token ids only); waits for its
        load (``wait_for_tokenizer``)."""
        self.wait_for_tokenizer()
        return self.outputs.tokenizer

    def get_tokenizer(self):
        """transformers' tokenizer (chat templates and the rest of its API). The engine's own ``tokenizer`` may be
        the stored Rust pipeline of a warm start (``tokenizer_store``); this loads transformers' on first use."""
        if not isinstance(self.tokenizer, StoredTokenizer):
            return self.tokenizer
        if self._transformers_tokenizer is None:
            self._transformers_tokenizer = load_tokenizer(self.tokenizer_path)
        return self._transformers_tokenizer

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    reject_over_length: bool = False):
        """Queue a request. Bad input raises ``ValueError`` and changes nothing (``InputProcessor``). A
        ``max_tokens`` beyond what the prompt leaves of ``max_model_len`` is capped, as vLLM's offline API does,
        or, with ``reject_over_length`` (the server's rule), a ``ValueError`` naming ``max_tokens``;
        ``max_tokens=None`` fills the context. The request as queued (its prompt ids after truncation, its
        ``max_tokens``) is ``requests[request_id]``."""
        params = SamplingParams() if params is None else params
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        processed = self.inputs.process(prompt, params, self.tokenizer, reject_over_length=reject_over_length)
        params = processed.params
        seed = params.seed if params.seed is not None else next(self._seeds)
        self.add(Request(request_id, processed.token_ids, params, next(self._arrivals), prompt=processed.text,
                         seed=seed))

    def add(self, request: Request):
        """Queue a request built by the caller, unchecked (``add_request`` validates its input first) but for its
        structured-output constraint, which is bound to the tokenizer here (an invalid one raises ValueError)."""
        self.wait_for_tokenizer()
        if request.sampling_params.structured_outputs is not None:
            self.structured_outputs.add(request)
        self.requests[request.request_id] = request
        self.outputs.add(request)
        self.scheduler.add(request)

    def abort_request(self, request_id: str):
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_work() or self._in_flight or self._aborted)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The matchers of the constrained requests (``structured_output.manager``), made on first use."""
        if self._structured is None:
            self._structured = StructuredOutputManager(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
        return self._structured

    # -- the loop --------------------------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that advanced (or, with ``only_finished``, that ended:
        offline batches skip building cumulative outputs, which costs O(length) per request and step).

        A constrained request's next mask needs its previous token: while one waits on a step in flight, that step
        is read back before scheduling (such steps do not overlap the host's work with the device's)."""
        start = time.perf_counter()
        if self._limited:  # a ready-early warm-up still compiles: steps stay within the compiled buckets
            limits = self.worker.limits()
            self.scheduler.limit(limits)
            self._limited = limits is not None
        structured = self._structured
        early = {}
        if structured and structured.waits_for_tokens():
            early, _ = self._read_back(self._in_flight)
            self._in_flight = []
        scheduled = self.scheduler.schedule()
        if structured:
            scheduled.token_bitmask = structured.bitmask(
                scheduled.decodes + [c.request for c in scheduled.prefills if c.samples])
        scheduled_at = time.perf_counter()
        result = self.worker.execute(scheduled)
        dispatched_at = time.perf_counter()
        self.scheduler.dispatched(result.handles, result.swapped_out)
        self.meter.totals["compressions"] += len(scheduled.compressions)
        changed, read_back_s = self._collect(result.handles, early)
        self.meter.totals["steps"] += 1
        if self.meter.due():
            self.meter.sample(self.stats())
        outputs = [self.outputs.output(r) for r in changed if r.status.finished or not only_finished]
        self._forget_finished(changed)
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
        outputs = [self.outputs.output(r) for r in changed if r.status.finished or not only_finished]
        self._forget_finished(changed)
        return outputs

    def _forget_finished(self, changed):
        for request in changed:
            if request.status.finished:
                if self._structured is not None:
                    self._structured.remove(request)
                self.requests.pop(request.request_id, None)
                self.outputs.states.pop(request.request_id, None)

    def _collect(self, handles, changed_before: dict | None = None) -> tuple[list[Request], float]:
        """Read back the steps in flight (``handles`` are in flight next); returns the requests that changed (since
        ``changed_before``, those of an earlier read-back) and the seconds spent waiting for their results."""
        changed, read_back_s = self._read_back(self._in_flight)
        changed = {**changed_before, **changed} if changed_before else changed
        self._in_flight = handles
        for request in self._aborted:
            changed[request.request_id] = request
        self._aborted = []
        return list(changed.values()), read_back_s

    def _read_back(self, handles) -> tuple[dict[str, Request], float]:
        changed, waited = {}, 0.0
        for handle in handles:
            start = time.perf_counter()
            for part in handle.prompt_logprobs:
                ids, values = part.result()
                for row, (request, position) in enumerate(zip(part.requests, part.positions)):
                    if not request.status.finished:
                        self.outputs.set_prompt_logprobs(request, position, ids[row], values[row])
            ids, values = handle.result()
            now = time.perf_counter()
            waited += now - start
            self.meter.count_read_back(handle.kind, handle.num_tokens, now)
            for row, request in enumerate(handle.requests):
                if request is None or request.status.finished:
                    continue
                token = int(ids[row, 0])
                self.scheduler.accept(request, token, float(values[row, 0]))
                stop = self.outputs.accept(request, ids[row], values[row])
                status = stop.status if stop is not None else None
                if status is None and self._structured and self._structured.accept(request, token):
                    status = RequestStatus.FINISHED_STOPPED  # the constraint is complete
                if status is not None:
                    self.scheduler.finish(request, status)
                    self.meter.totals["finished"] += 1
                changed[request.request_id] = request
        return changed, waited

    # -- observability ---------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the loop's state: the scheduler's, the worker's and the loop's own counters."""
        return EngineStats(self.scheduler.stats(), self.worker.stats(), collections.Counter(self.meter.totals),
                           self.compile_counter.count, self.memory_plan.max_concurrency)

    def metrics(self) -> dict:
        """Gauges and counters of the loop (``engine.metrics``): running / waiting, pages, prefix-cache hits, token
        rates, compression share, compiles, query rows."""
        return self.meter.metrics(self.stats())

    @property
    def compiling_in_background(self) -> bool:
        """Whether a ready-early warm-up's background compiles still limit the steps."""
        return self._limited and self.worker.limits() is not None

    @property
    def compiling_unused(self) -> bool:
        """Whether compiles nobody waits for still run (a stopped warm-up's): a process exiting now would wait for
        them (``core_client.exit_if_compiling``)."""
        return self.worker.programs.compiling_unused

    def join_background_compiles(self):
        """Wait until a ready-early warm-up's background compiles are done (benchmarks; a server never waits)."""
        self.worker.programs.join_background()

    def metrics_history(self) -> list[dict]:
        """Samples of the scheduler state every ``metrics_interval_steps`` steps (oldest first, bounded)."""
        return list(self.meter.samples)

    def reset_metrics_history(self):
        """Start the metrics history and the time shares of ``metrics()`` afresh from now (a benchmark's
        workload after its warm-up): earlier samples are dropped, rates and shares count from here."""
        self.meter.reset(self.stats())

    def add_step_observer(self, observer):
        """Call ``observer(StepRecord)`` after every ``step``: what the scheduler decided and where the step's host
        time went (benchmarks time steps this way; a server could log slow ones)."""
        self._step_observers.append(observer)

    def remove_step_observer(self, observer):
        self._step_observers.remove(observer)

    def add_compression_observer(self, observer):
        """``observer(dispatch, run)`` around each compression dispatch (``Worker.add_compression_observer``): a
        benchmark times compressions this way (its syncs then count in the compression shares) or traces them."""
        self.worker.add_compression_observer(observer)

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile every shape bucket now (in parallel), so no request waits on a compile later; each compile is
        logged and passed to ``progress(done, total, name, seconds)``. Returns the number of programs and the wall
        seconds they took. ``stop``: a ``concurrent.futures.Future`` whose completion ends the warm-up at once
        (``CompileStopped``; the rest compiles on first use), as the server does when asked to shut down.

        ``ready_early``: return once the programs of a light load are ready and compile the rest in the background
        (``background`` in the report); until then steps take no more rows and prompt tokens than the compiled
        programs cover (``ProgramCatalog.limits``): requests beyond wait in the queue, never on a compile."""
        def logged(*args):
            log_compile(*args)
            if progress is not None:
                progress(*args)

        report = self.worker.warmup(logged, stop, ready_early=ready_early)
        self.wait_for_tokenizer()  # ready means ready for text too
        self._limited = ready_early and bool(report.get("background"))
        self.meter.mark_steady(self.stats())
        log_warmup(report)
        return report


def tokenizer_dir(config: EngineConfig, model_path: str) -> str:
    """Where the tokenizer's files are: ``config.tokenizer`` (a directory or Hub id), else the model's."""
    path = hub.local_dir(config.tokenizer, "tokenizer") if config.tokenizer else model_path
    if not any((pathlib.Path(path) / name).is_file() for name in TOKENIZER_FILES):
        field = "tokenizer" if config.tokenizer else "model"
        raise ValueError(f"{field}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})"
                         f"{'' if config.tokenizer else '; name one with tokenizer'}")
    return path


def log_warmup(report: dict):
    log.info("warm-up: %d programs ready in %.1fs (%d loaded from the executable store in %.1fs; tracing %.1fs, "
             "compiling %.1fs summed over the parallel compiles)", report["programs"], report["compile_s"],
             report.get("loaded", 0), report.get("load_s", 0.0), report.get("lower_s", 0.0),
             report.get("compile_sum_s", 0.0))
    if report.get("background"):
        log.info("serving now; %d more programs compile in the background", report["background"])


def log_compile(done: int, total: int, name: str, seconds: float):
    log.info("compiling %d/%d: %s (%.1fs)", done, total, name, seconds)
