"""The server's engine loop in a process of its own (``core_client.ProcessCore``, what ``serve`` runs): its outputs
cross as deltas that rebuild the cumulative outputs exactly (late stop-string truncation included), its messages
pickle, requests behave as with the loop on a thread, cancellations give their pages back, the engine's own errors
are 400s, what it truncated comes back, hostile prompts stall no stream, and a lost engine process fails what was in
flight and turns /health to 503."""


import contextlib
import importlib
import itertools
import json
import pickle
import signal
import statistics
import threading
import time
from multiprocessing.connection import Connection

import httpx
import openai
import pytest

from live_server import live_server, stream_all_cancelling_odd
from seeds import seeded_rng
from waiting import HANG_S, wait_until
from zipage_jax.engine import core_client
from zipage_jax.engine.core_client import ProcessCore
from zipage_jax.engine.engine_core import Reported, output_delta
from zipage_jax.engine.messages import (Abort, Accepted, Added, AddRequests, Built, Failed, Metrics, NewRequest,
                                        OutputDelta, Refused, Stop)
from zipage_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.engine.tokenizer_store import ServingTokenizer, load_engine_tokenizer
from zipage_jax.sampling_params import ContextLengthError, SamplingParams

from test_serve import TINY_MODEL, chat_ids, make_engine, offline

pytestmark = pytest.mark.usefixtures("without_jax_cache")  # these tests start engines on an executable store

BASELINE_CHUNKS = 40  # a stream's chunks before the hostile requests: its typical gap, one engine step
GAP_FACTOR = 25  # how many of those its longest gap may span while they are refused
OPTIONS = dict(max_num_seqs=16, page_size=16, max_model_len=512, max_num_batched_tokens=256, dtype="float32",
               max_num_prefill_seqs=8, num_gpu_pages_override=512, compilation_cache_dir=None)


def test_deltas_rebuild_the_cumulative_outputs_including_late_truncation():
    """What the engine loop sends (``output_delta``) applied by the server's side (``ChoiceOutput``) gives back
    the engine's cumulative output, the tokens a stream took along the way included; prompt logprobs cross until
    they have crossed complete."""
    rng = seeded_rng()
    for _ in range(50):
        text, ids, logprobs, reported = "", [], [], Reported()
        rebuilt, taken_ids, taken_logprobs = ChoiceOutput(), [], []
        computed, crossed = 1, False  # prompt positions whose logprobs are known (nothing predicts the first)
        for step in range(int(rng.integers(1, 12))):
            new = int(rng.integers(0, 4))
            ids = ids + [int(t) for t in rng.integers(0, 100, new)]
            logprobs = logprobs + [{i: Logprob(-float(i))} for i in ids[len(logprobs):]]
            text = text + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(0, 6))))
            finished = step > 0 and rng.random() < 0.2
            if finished and text:  # a stop string completed late: text already reported is taken back
                text = text[:int(rng.integers(0, len(text)))]
            computed = min(computed + int(rng.random() < 0.5), 3)  # the prompt's next chunk, maybe
            prompt_logprobs = [None] + [{7: Logprob(-1.0)} if i < computed else None for i in (1, 2)]
            out = RequestOutput("r", None, [1, 7, 7], [CompletionOutput(0, text, list(ids), -1.0, list(logprobs),
                                                                        "stop" if finished else None)], finished,
                                prompt_logprobs=prompt_logprobs)
            delta = output_delta(out, reported)
            assert isinstance(delta, OutputDelta) and len(delta.token_ids) <= new
            assert (delta.prompt_logprobs is None) == crossed  # sent until sent complete, then never again
            crossed = computed == 3
            rebuilt.apply(delta)
            if rng.random() < 0.5:  # a stream sends what it holds
                took_ids, took_logprobs = rebuilt.take_tokens()
                taken_ids += took_ids
                taken_logprobs += took_logprobs
            assert (rebuilt.text, taken_ids + rebuilt.token_ids, taken_logprobs + rebuilt.logprobs) == \
                (text, ids, logprobs)
            assert rebuilt.num_tokens == len(ids) and rebuilt.num_taken == len(taken_ids)
            assert rebuilt.prompt_logprobs == prompt_logprobs
            assert delta.finished == finished and rebuilt.finish_reason == out.outputs[0].finish_reason
            if finished:
                break


def test_messages_cross_a_pipe_as_they_were_sent():
    """Commands and events pickle (the engine process is spawned), and a refusal names its field."""
    request = NewRequest("r-0", [5, 6], SamplingParams(max_tokens=None, truncate_prompt_tokens=1))
    for message in [AddRequests(3, [request, request]), Abort(["r-0"]), Stop(), Added(3, [Accepted(1, [6])]),
                    Failed(["r-0"], "gone", True), Metrics({"num_running": 1})]:
        assert pickle.loads(pickle.dumps(message)) == message
    refused = Refused.of(3, ContextLengthError("max_tokens: 'max_tokens' or 'max_completion_tokens' is too large"))
    assert (refused.field, refused.over_context, refused.bad_input) == ("max_tokens", True, True)
    assert refused.reason.startswith("'max_tokens' or")
    assert Refused.of(3, ValueError("prompt: empty prompt")) == Refused(3, "prompt: empty prompt", "prompt")
    assert Refused.of(3, ValueError("no field here")).field is None
    assert not Refused.of(3, KeyError("bug")).bad_input


@pytest.fixture(scope="module")
def reference():
    return make_engine(**{k: v for k, v in OPTIONS.items() if k != "num_gpu_pages_override"})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The engine process on a cache whose tokenizer store a first start filled: its server encodes through the
    stored pipeline and renders chat templates with transformers' tokenizer (``ServingTokenizer``)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    load_engine_tokenizer(TINY_MODEL, cache)
    with watched_transformers_import() as tokenizer_loads:
        core = ProcessCore.launch(TINY_MODEL, {**OPTIONS, "compilation_cache_dir": cache}, warmup=False,
                                  log_level="WARNING")
    with live_server(core, max_queued_requests=16) as server:
        server.core, server.tokenizer_loads = core, tokenizer_loads
        yield server


@contextlib.contextmanager
def watched_transformers_import():
    """While the engine process starts, the import of transformers that ``launch`` begins on a thread lasts until
    the engine is built (as when a warm start builds it within the import's second); yields, for each tokenizer
    load, whether that import was over by then (a `from transformers import ...` that meets it half done raises)."""
    built, imported, tokenizer_loads = threading.Event(), threading.Event(), []
    real_import, real_recv, real_load = importlib.import_module, Connection.recv, core_client.load_serving_tokenizer

    def held_import(name, *args):
        if name != "transformers":
            return real_import(name, *args)
        built.wait(HANG_S)
        module = real_import(name, *args)
        imported.set()
        return module

    def recv(self):
        message = real_recv(self)
        if isinstance(message, Built):
            built.set()
        return message

    def load(*args):
        tokenizer_loads.append(imported.is_set())
        return real_load(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib, "import_module", held_import)
        patch.setattr(Connection, "recv", recv)
        patch.setattr(core_client, "load_serving_tokenizer", load)
        yield tokenizer_loads


def test_the_tokenizer_loads_once_the_transformers_import_begun_by_the_launch_is_over(live):
    assert live.tokenizer_loads == [True]


def model_of(live) -> str:
    return live.client().models.list().data[0].id


def test_requests_through_the_engine_process_match_the_engine(live, reference):
    client, model = live.client(), model_of(live)
    for prompt, params in [("What is 12+7?", dict(max_tokens=40)), ("abc", dict(max_tokens=30, stop=["1", " "]))]:
        want, _ = offline(reference, prompt, temperature=0.0, logprobs=2, **params)
        got = client.completions.create(model=model, prompt=prompt, temperature=0, logprobs=2, **params)
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
        assert got.choices[0].logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in
                                                                        zip(want.token_ids, want.logprobs)], abs=1e-5)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=prompt, temperature=0, stream=True, **params))
        assert streamed == want.text


def test_chat_through_the_stored_tokenizer_matches_the_engine(live, reference):
    assert isinstance(live.core.tokenizer, ServingTokenizer)
    messages = [{"role": "user", "content": "What is 12+7?"}]
    want, _ = offline(reference, chat_ids(reference, messages), temperature=0.0, max_tokens=30)
    got = live.client().chat.completions.create(model=model_of(live), messages=messages, temperature=0, max_tokens=30)
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(chat_ids(reference, messages))


def test_cancelled_streams_give_their_pages_back_and_engine_errors_are_400(live, reference):
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "an idle server")
    before = live.metrics()
    prompts = [f"client {i}: {'ab' * (i % 5)}" for i in range(12)]
    wants = {i: offline(reference, p, temperature=0.0, max_tokens=24)[0].text for i, p in enumerate(prompts)}

    after = stream_all_cancelling_odd(live, model_of(live), prompts, wants, max_tokens=24, cancel_max_tokens=300)
    assert after["zipage:kv_pages_used"] == before["zipage:kv_pages_used"]
    assert after["zipage:server_client_aborts_total"] - before["zipage:server_client_aborts_total"] == 6
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 6
    with pytest.raises(openai.BadRequestError) as err:  # the engine process's own check: ids beyond the vocabulary
        live.client().completions.create(model=model_of(live), prompt=[5, 10**6], max_tokens=2)
    assert "token ids must be ints" in err.value.message and err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # a context overflow keeps its kind across the pipe
        live.client().completions.create(model=model_of(live), prompt=[5, 6], max_tokens=10**6)
    assert (err.value.body["param"], err.value.body["code"]) == ("max_tokens", "context_length_exceeded")


def test_a_truncated_prompt_comes_back_from_the_engine_process(live, reference):
    ids = reference.tokenizer.encode("What is 12+7? Think step by step.", add_special_tokens=False)
    got = live.client().completions.create(model=model_of(live), prompt=ids, echo=True, max_tokens=3,
                                           temperature=0, extra_body={"truncate_prompt_tokens": 4})
    want, prompt_len = offline(reference, ids[-4:], temperature=0.0, max_tokens=3)
    assert got.choices[0].text == reference.tokenizer.decode(ids[-4:]) + want.text
    assert got.usage.prompt_tokens == prompt_len == 4 < len(ids)


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_stream(live):
    """While a stream runs: a 10 MB prompt (over the body cap: 413), a prompt over the character cap (400, never
    tokenized) and one at the cap (tokenized off the event loop, then refused by the engine: over the context).
    Meanwhile the stream's longest chunk gap stays within GAP_FACTOR of its median gap, one engine step as the
    client sees it (the engine steps in its own process, so a stalled event loop would show as one long gap)."""
    model, cap = model_of(live), 32 * OPTIONS["max_model_len"]
    hostile = [({"model": model, "prompt": "x" * 10_000_000}, 413, "request_too_large"),
               ({"model": model, "prompt": "x" * (cap + 1)}, 400, "prompt_too_long"),
               ({"model": model, "prompt": "y " * (cap // 2)}, 400, "context_length_exceeded")]
    bodies = [(json.dumps(body).encode(), status, code) for body, status, code in hostile]  # encoded beforehand
    arrivals, streaming = [], threading.Event()

    def stream():
        body = {"model": model, "prompt": "forever", "max_tokens": 480, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                arrivals.append(time.perf_counter())
                if len(arrivals) == BASELINE_CHUNKS:
                    streaming.set()

    client = threading.Thread(target=stream)
    client.start()
    assert streaming.wait(HANG_S)
    begin = time.perf_counter()
    for body, status, code in bodies:
        r = httpx.post(f"{live.url}/v1/completions", content=body, timeout=HANG_S,
                       headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    end = time.perf_counter()
    client.join(HANG_S)
    gaps = [(after - before, before, after) for before, after in itertools.pairwise(arrivals)]
    baseline = [gap for gap, _, after in gaps if after < begin]
    during = [gap for gap, before, after in gaps if after >= begin and before <= end]
    bound = max(GAP_FACTOR * statistics.median(baseline), 2 * max(baseline))  # a loaded machine's own hiccups
    assert max(during, default=0.0) <= bound, (max(during), statistics.median(baseline), max(baseline))
    assert arrivals[-1] > end, "the stream must outlast the hostile requests"


def test_a_launch_error_is_the_engines_value_error():
    with pytest.raises(ValueError, match="max_model_len"):
        ProcessCore.launch(TINY_MODEL, {**OPTIONS, "max_model_len": 10**6}, warmup=False, log_level="WARNING")


def test_a_lost_engine_process_fails_what_is_in_flight_and_health_says_so(live):
    """The module's last test: it kills the module's engine process (a second one would cost a start)."""
    client, model = live.client(), model_of(live)
    stream = client.completions.create(model=model, prompt="forever", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    live.core._process.kill()
    with pytest.raises(openai.APIError, match="engine process exited"):
        for _ in stream:
            pass
    wait_until(lambda: live.get("/health").status_code == 503, "/health to report the lost engine")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2)
    assert err.value.status_code == 503


def test_a_ctrl_c_another_thread_takes_while_the_engine_process_starts_waits_for_the_start():
    """The SIGINT mask is per thread: a Ctrl-C delivered to another thread of the server must still not interrupt
    the main thread while it hands the engine process its start-up data; it is raised once the start is over."""
    from zipage_jax.engine.core_client import _sigint_blocked

    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    go, reached = threading.Event(), []

    def ctrl_c():  # a thread started before the block: SIGINT is not blocked in it
        go.wait()
        signal.raise_signal(signal.SIGINT)

    thread = threading.Thread(target=ctrl_c)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with _sigint_blocked():
                go.set()
                thread.join()
                for _ in range(1000):  # bytecode boundaries, where a pending Python handler runs
                    pass
                reached.append(True)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert reached == [True]
