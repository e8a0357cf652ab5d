"""The OpenAI-compatible server, exercised through real HTTP on loopback with the real `openai` client.

The oracle for every generated text is the same engine driven offline (add_request / step), so the server must
be transparent: same text, finish reasons and token counts, whatever the transport (stream or not, n, stops).
"""

import contextlib
import importlib.metadata
import itertools
import json
import logging
import pathlib
import re
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import live_server, stream_all_cancelling_odd
from waiting import HANG_S, wait_until
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.config import engine_kwargs, option_fields
from zipage_jax.entrypoints.api_server import create_app
from zipage_jax.entrypoints.cli_args import build_parser, parse_args
from zipage_jax.entrypoints.prometheus import ServerMetrics
from zipage_jax.entrypoints.sampling_defaults import sampling_defaults
from zipage_jax.entrypoints.serving_completion import OpenAIServingCompletion
from zipage_jax.entrypoints.serving_engine import stable_text_len
from zipage_jax.worker.programs import Programs

pytestmark = pytest.mark.usefixtures("without_jax_cache")  # these tests start engines on an executable store

TINY_MODEL = "zipage_jax/assets/tiny-reasoner"


_store_dir = None  # the module's executable store (``programs_shared_in_the_module``)


def make_engine(**overrides):
    """The engine under test: the real engine on the shipped tiny model (small pages, CPU-sized buckets). Engines
    of one config share their compiled programs through the module's store: each compiles once."""
    opts = dict(max_num_seqs=64, page_size=16, max_model_len=512, max_num_batched_tokens=256, dtype="float32",
                max_num_prefill_seqs=8, num_gpu_pages_override=1024, compilation_cache_dir=_store_dir)
    return LLMEngine.from_kwargs(TINY_MODEL, **{**opts, **overrides})


@pytest.fixture(scope="module", autouse=True)
def programs_shared_in_the_module(tmp_path_factory):
    """The server's engine, the offline oracle and the engines single tests build of the same config compile the
    same programs: the first to need one compiles it, the others load it from a store that lives as long as the
    module (tests that count compiles build their engines with ``compilation_cache_dir=None``)."""
    global _store_dir
    _store_dir = str(tmp_path_factory.mktemp("executable_store"))
    yield
    _store_dir = None


# -- helpers ----------------------------------------------------------------------------------------------------
_ref_ids = itertools.count()


def offline(engine, prompt, **params):
    """Oracle: the final CompletionOutput of one request driven straight through the engine contract."""
    final = offline_request(engine, prompt, **params)
    return final.outputs[0], len(final.prompt_token_ids)


def offline_batch(engine, prompts, **params) -> list:
    """Oracle of several prompts with the same params, run as one batch (as a server runs its clients' requests):
    the final CompletionOutput of each, in order."""
    request_ids = [f"ref-{next(_ref_ids)}" for _ in prompts]
    for request_id, prompt in zip(request_ids, prompts):
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        engine.add_request(request_id, ids, SamplingParams(**params))
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out.outputs[0]) for out in engine.step() if out.finished)
    return [final[request_id] for request_id in request_ids]


def offline_request(engine, prompt, **params):
    """The final RequestOutput of one request driven straight through the engine contract."""
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
    request_id = f"ref-{next(_ref_ids)}"
    engine.add_request(request_id, ids, SamplingParams(**params))
    final = None
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None
    return final


def chat_ids(engine, messages) -> list[int]:
    text = engine.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def reference():
    return make_engine()


@pytest.fixture(scope="module")
def live(engine):
    with live_server(engine, max_queued_requests=64) as server:
        yield server


@pytest.fixture(scope="module")
def model(live):
    return live.client().models.list().data[0].id


def model_of(live) -> str:
    return live.client().models.list().data[0].id


# -- pure pieces ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,stops,expected", [
    ("hello wor", ("world",), len("hello ")),     # "wor" may become "world": hold it
    ("hello", ("world",), 5),                      # no stop prefix at the end
    ("abcST", ("STOP", "Tx"), 3),                  # the longer held suffix wins ("ST" vs "T")
    ("abc\ufffd", (), 3),                          # incomplete UTF-8 is held
    ("abcS\ufffd", ("ST",), 3),                    # both
    ("", ("x",), 0),
    ("aaa", ("aaab",), 0),                         # the whole text may start the stop string
])
def test_stable_text_len_holds_back_what_a_stop_could_retract(text, stops, expected):
    assert stable_text_len(text, stops) == expected


def test_cli_documents_every_engine_option_and_maps_it_to_engine_kwargs():
    fields = set(option_fields())  # EngineConfig's fields, the nested scoring knobs flat
    assert {"window", "eviction_policy", "redundancy"} < fields and "scoring" not in fields
    text = build_parser().format_help()
    assert "mosaic_decode" in text and "KV pool size in pages instead" in text  # the field descriptions
    for flag in ["--model", "--host", "--port", "--api-key", "--max-queued-requests", "--shutdown-timeout",
                 *("--" + name.replace("_", "-") for name in fields)]:
        assert flag in text, flag
    _, args = parse_args(["--page-size", "32", "--no-enable-prefix-caching", "--dtype", "float32", "--window", "8"])
    assert engine_kwargs(args, args.engine_fields) == {"page_size": 32, "enable_prefix_caching": False,
                                                       "dtype": "float32", "window": 8}
    assert args.host == "127.0.0.1" and args.model.endswith("tiny-reasoner")
    out = subprocess.run([sys.executable, "-m", "zipage_jax.serve", "--help"], capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0 and "--kv-cache-memory-bytes" in out.stdout


def test_cli_refuses_several_processes(capsys):
    from zipage_jax.entrypoints.api_server import main

    with pytest.raises(SystemExit):
        main(["--coordinator-address", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "0"])
    assert "--num-processes" in capsys.readouterr().err


# -- generation ---------------------------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox", "naïve café — ünïcødé ✓", "x"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline_generation(live, model, reference, prompt):
    want, prompt_len = offline(reference, prompt, temperature=0.0, max_tokens=40)
    got = live.client().completions.create(model=model, prompt=prompt, temperature=0, max_tokens=40)
    assert got.object == "text_completion" and len(got.choices) == 1
    assert got.choices[0].text == want.text and want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_len, len(want.token_ids))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_concatenates_to_offline_text(live, model, reference, prompt):
    want, prompt_len = offline(reference, prompt, temperature=0.0, max_tokens=40)
    chunks = list(live.client().completions.create(model=model, prompt=prompt, temperature=0, max_tokens=40,
                                                   stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(live, model):
    body = {"model": model, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "text_completion"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline_generation_of_the_chat_template(live, model, engine, reference, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo there"}]
    want, prompt_len = offline(reference, chat_ids(engine, messages), temperature=0.0, max_tokens=60)
    client = live.client()
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        got = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60)
        assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_len, len(want.token_ids))
        text, finish = got.choices[0].message.content, got.choices[0].finish_reason
    assert text == want.text and text
    assert finish == want.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_choices_use_seed_plus_index(live, model, reference, stream):
    prompt, n, seed = "What is 12345*", 4, 1234  # an unfinished question: the model is unsure what comes next
    wants = [offline(reference, prompt, temperature=1.0, seed=seed + i, max_tokens=30)[0] for i in range(n)]
    assert len({w.text for w in wants}) > 1, "the oracle's seeds must give distinct choices"
    kw = dict(model=model, prompt=prompt, n=n, seed=seed, temperature=1.0, max_tokens=30)
    if stream:
        texts = [""] * n
        for c in live.client().completions.create(stream=True, **kw):
            for choice in c.choices:
                texts[choice.index] += choice.text
    else:
        got = live.client().completions.create(**kw)
        assert [c.index for c in got.choices] == list(range(n))
        assert got.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
        texts = [c.text for c in got.choices]
    assert texts == [w.text for w in wants]


def test_prompt_batch_gives_n_choices_per_prompt_in_order(live, model, reference):
    prompts = ["first prompt", "second one"]
    got = live.client().completions.create(model=model, prompt=prompts, n=2, temperature=0, max_tokens=20)
    wants = [want.text for want in offline_batch(reference, prompts, temperature=0.0, max_tokens=20) for _ in range(2)]
    assert [c.text for c in got.choices] == wants


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_choice_and_is_never_streamed(live, model, reference, stream):
    # With the echo model "ST" comes before the real stop "STOP": a stream must hold it back until it is known
    # not to start a stop. Other models stop on a piece of their own greedy text.
    prompt = "alpha ST beta STOP gamma"
    full, _ = offline(reference, prompt, temperature=0.0, max_tokens=60)
    stop = ["STOP" if "STOP" in full.text else full.text[len(full.text) // 2:][:3], "zzz"]
    want, _ = offline(reference, prompt, temperature=0.0, max_tokens=60, stop=stop)
    assert want.finish_reason == "stop" and len(want.text) < len(full.text) and stop[0] not in want.text
    kw = dict(model=model, prompt=prompt, temperature=0, max_tokens=60, stop=stop)
    if stream:
        # A sent piece cannot be taken back, so the concatenation matching means nothing was over-sent.
        text = "".join(c.choices[0].text for c in live.client().completions.create(stream=True, **kw))
    else:
        text = live.client().completions.create(**kw).choices[0].text
    assert text == want.text


def test_logprobs_are_returned_per_token(live, model, reference):
    want, _ = offline(reference, "log me", temperature=0.0, max_tokens=8, logprobs=True)
    got = live.client().completions.create(model=model, prompt="log me", temperature=0, max_tokens=8, logprobs=0)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        [entry[token].logprob for token, entry in zip(want.token_ids, want.logprobs)])
    assert len(got.choices[0].logprobs.tokens) == len(want.token_ids)
    chat = live.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 temperature=0, max_tokens=8, logprobs=True)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(item.logprob <= 0 for item in chat.choices[0].logprobs.content)


def test_kv_budget_pages_extension_reaches_the_engine(live, model):
    with pytest.raises(openai.BadRequestError, match="compression off"):  # this server runs full KV
        live.client().completions.create(model=model, prompt="budget", extra_body={"kv_budget_pages": 2})
    with pytest.raises(openai.BadRequestError, match="kv_budget_pages"):
        live.client().completions.create(model=model, prompt="budget", extra_body={"kv_budget_pages": 0})
    with live_server(make_engine(compression=True, kv_budget_pages=8)) as compressed:
        got = compressed.client().completions.create(model=model, prompt="budget", max_tokens=60,
                                                     extra_body={"kv_budget_pages": 2, "ignore_eos": True})
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 60


# -- vLLM's request surface -------------------------------------------------------------------------------------
QUESTION = "<|im_start|>user\nWhat is 67815*55?<|im_end|>\n<|im_start|>assistant\n"  # the shipped model's task


def sse_events(url, body) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=HANG_S) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(live, model, engine, path):
    chat = path.endswith("chat/completions")
    body = {"model": model, "max_tokens": 30, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": [{"role": "user", "content": "What is 67815*55?"}]} if chat else {"prompt": QUESTION})
    events = sse_events(f"{live.url}{path}", body)
    prompt_tokens = len(chat_ids(engine, body["messages"]) if chat else engine.tokenizer.encode(QUESTION))
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 30
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in events)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in events)
    assert counts == sorted(counts) and counts[-1] == 30 and len(set(counts)) > 1
    client = live.client()
    if chat:
        stream = client.chat.completions.create(model=model, messages=body["messages"], max_tokens=5, stream=True,
                                                stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True})
    else:
        stream = client.completions.create(model=model, prompt=QUESTION, max_tokens=5, stream=True,
                                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(chunk.usage is not None for chunk in stream)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_n_most_likely_and_the_token(live, model, reference, stream):
    want, _ = offline(reference, QUESTION, temperature=0.0, max_tokens=12, logprobs=3)
    kw = dict(model=model, prompt=QUESTION, temperature=0, max_tokens=12, logprobs=3)
    if stream:
        tokens, values, tops, offsets = [], [], [], []
        for chunk in live.client().completions.create(stream=True, **kw):
            lp = chunk.choices[0].logprobs
            if lp is not None:
                tokens += lp.tokens
                values += lp.token_logprobs
                tops += lp.top_logprobs
                offsets += lp.text_offset
    else:
        lp = live.client().completions.create(**kw).choices[0].logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert tokens == [reference.tokenizer.decode([t]) for t in want.token_ids]
    assert values == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, value, top, entry in zip(tokens, values, tops, want.logprobs):
        assert len(top) <= 4 and top[token] == value  # the 3 most likely and the sampled token
        assert max(top.values()) == value  # greedy: the sampled token is the most likely
        ranked = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([lp.logprob for lp in ranked], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_sorted_and_contain_the_sampled_token(live, model, stream):
    kw = dict(model=model, messages=[{"role": "user", "content": "What is 67815*55?"}], temperature=0,
              max_tokens=10, logprobs=True, top_logprobs=4)
    if stream:
        content = [item for chunk in live.client().chat.completions.create(stream=True, **kw)
                   if chunk.choices and chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    else:
        content = live.client().chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 10
    for item in content:
        assert len(item.top_logprobs) == 4
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token and values[0] == item.logprob  # greedy
        assert item.bytes == list(item.token.encode())


def test_lm_eval_loglikelihood_payload_scores_the_prompt(live, model, reference):
    """lm-eval's `local-completions` scores a context + continuation with echo, logprobs 1 and max_tokens 0 (vLLM)
    or 1, token-id prompts; the first prompt token's logprob is null, the others are the engine's."""
    ids = reference.tokenizer.encode(QUESTION + "01:5187600\n02:", add_special_tokens=False)
    want = offline_request(reference, ids, temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for max_tokens in (0, 1):
        body = {"model": model, "prompt": [ids], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
                "seed": 1234, "echo": True}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens and choice["text"].startswith(reference.tokenizer.decode(ids))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
            [want.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))], abs=1e-5)
        for t in range(1, len(ids)):  # what lm-eval's is_greedy reads: the token against the best alternative
            top = lp["top_logprobs"][t]
            assert lp["tokens"][t] in top and len(top) <= 2
            assert (max(top.values()) == lp["token_logprobs"][t]) == (want.prompt_logprobs[t][ids[t]].rank == 1)
        if max_tokens == 0:
            assert choice["text"] == reference.tokenizer.decode(ids) and r.json()["usage"]["completion_tokens"] == 0
    got = live.client().completions.create(model=model, prompt=QUESTION, echo=True, logprobs=1, max_tokens=0)
    assert got.choices[0].text == QUESTION and got.choices[0].logprobs.token_logprobs[0] is None


def test_prompt_logprobs_field_in_vllm_shape(live, model, reference):
    ids = reference.tokenizer.encode(QUESTION, add_special_tokens=False)
    want = offline_request(reference, ids, temperature=0.0, max_tokens=2, prompt_logprobs=2)
    r = httpx.post(f"{live.url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2,
                                                       "temperature": 0, "prompt_logprobs": 2}, timeout=HANG_S)
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for t in range(1, len(ids)):
        assert list(entries[t]) == [str(k) for k in want.prompt_logprobs[t]]
        own = entries[t][str(ids[t])]
        assert own["logprob"] == pytest.approx(want.prompt_logprobs[t][ids[t]].logprob, abs=1e-5)
        assert own["rank"] == want.prompt_logprobs[t][ids[t]].rank and own["decoded_token"]
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=HANG_S,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_vllm_benchmark_client_payloads_get_200(live, model):
    """The payloads of vLLM's serving benchmark (completions and chat), and one with continuous usage."""
    completion = {"model": model, "prompt": QUESTION, "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = sse_events(f"{live.url}/v1/completions", completion)
    assert events[-1]["usage"]["completion_tokens"] == 8 and all(e["usage"] is None for e in events[:-1])
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 1*2?"}]}],
            "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert sse_events(f"{live.url}/v1/chat/completions", chat)[-1]["usage"]["completion_tokens"] == 8
    continuous = {"model": model, "prompt": QUESTION, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                  "request_id": "bench-0"}
    assert sse_events(f"{live.url}/v1/completions", continuous)[-1]["usage"]["completion_tokens"] == 8


def test_ignored_fields_are_named_in_one_warning_per_request(live, model, caplog):
    def warnings():
        return [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="zipage_jax.entrypoints.serving_engine"):
        body = _completion(model=model, request_id="r1", cache_salt="salt", vllm_xargs={"a": 1}, length_penalty=2.0,
                           best_of=1, logit_bias={}, user="someone", add_special_tokens=True)
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=HANG_S).status_code == 200
        assert len(warnings()) == 1
        assert all(name in warnings()[0] for name in ("request_id", "cache_salt", "vllm_xargs", "length_penalty"))
        assert not any(name in warnings()[0] for name in ("best_of", "logit_bias", "user", "add_special"))
        chat = _chat(model=model, max_tokens=2, service_tier="auto", parallel_tool_calls=False, tool_choice="none",
                     stream_options={"include_usage": True, "extra": 1}, stream=True,
                     messages=[{"role": "user", "content": "hi", "reasoning_content": None}])
        sse_events(f"{live.url}/v1/chat/completions", chat)
        assert len(warnings()) == 2
        assert all(name in warnings()[1] for name in ("service_tier", "stream_options.extra",
                                                      "messages[].reasoning_content"))
        assert httpx.post(f"{live.url}/v1/completions", json=_completion(model=model), timeout=HANG_S).status_code == 200
        assert len(warnings()) == 2  # nothing ignored: no warning


def test_the_engine_validates_what_the_client_asked_and_its_refusal_is_a_400_naming_the_field(live, model, engine):
    """The server passes the prompt and max_tokens on as the client sent them (no truncation, no budget of its
    own); the engine truncates, fits and refuses, and its ValueError reaches the client as a 400 naming the field
    (``messages`` for a chat prompt), a context overflow with vLLM's code."""
    seen, real_add = [], engine.add_request

    def recording_add(request_id, prompt, params, **kwargs):
        seen.append((len(prompt), params, kwargs))
        if params.presence_penalty == 1.5:
            raise ValueError("presence_penalty: refused by the engine")
        return real_add(request_id, prompt, params, **kwargs)

    engine.add_request = recording_add
    try:
        messages = [{"role": "user", "content": "What is 67815*55?"}]
        got = live.client().chat.completions.create(model=model, messages=messages, temperature=0,
                                                    extra_body={"truncate_prompt_tokens": 5, "max_tokens": None})
        [(sent_len, params, kwargs)] = seen
        assert sent_len == len(chat_ids(engine, messages)) > 5 and params.truncate_prompt_tokens == 5
        assert params.max_tokens is None and kwargs == {"reject_over_length": True}
        assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError) as err:
            live.client().completions.create(model=model, prompt="hi", presence_penalty=1.5)
        assert err.value.body["param"] == "presence_penalty" and "refused by the engine" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            live.client().chat.completions.create(model=model, messages=messages, max_tokens=engine.max_model_len)
        assert (err.value.body["param"], err.value.body["code"]) == ("max_tokens", "context_length_exceeded")
        assert err.value.body["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large")
        with pytest.raises(openai.BadRequestError) as err:
            live.client().chat.completions.create(model=model, messages=[
                {"role": "user", "content": "y " * engine.max_model_len}])
        assert (err.value.body["param"], err.value.body["code"]) == ("messages", "context_length_exceeded")
        assert err.value.body["message"].startswith("This model's maximum context length is")
    finally:
        del engine.add_request


@pytest.mark.parametrize("stream", [False, True])
def test_a_truncated_prompt_is_echoed_and_counted_as_the_engine_kept_it(live, model, engine, stream):
    long = engine.tokenizer.encode(QUESTION, add_special_tokens=False)
    short = long[:7]
    kw = dict(model=model, prompt=[long, short], n=2, max_tokens=4, temperature=0, echo=True, logprobs=0,
              extra_body={"truncate_prompt_tokens": 12})
    if stream:
        texts, tokens = [""] * 4, [[] for _ in range(4)]
        for chunk in live.client().completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
                tokens[c.index] += c.logprobs.tokens
            usage = chunk.usage
    else:
        got = live.client().completions.create(**kw)
        texts, tokens, usage = [c.text for c in got.choices], [c.logprobs.tokens for c in got.choices], got.usage
    echoed = [engine.tokenizer.decode(long[-12:])] * 2 + [engine.tokenizer.decode(short)] * 2
    assert all(text.startswith(prompt) for text, prompt in zip(texts, echoed)), texts
    assert [len(t) for t in tokens] == [12 + 4] * 2 + [7 + 4] * 2
    assert (usage.prompt_tokens, usage.completion_tokens) == (12 + 7, 4 * 4)


def test_stop_special_token_truncation_and_chat_template_fields(live, model, engine, reference):
    client = live.client()
    kw = dict(model=model, prompt=QUESTION, temperature=0, max_tokens=60)
    line = client.completions.create(stop=["\n"], **kw).choices[0]
    kept = client.completions.create(stop=["\n"], extra_body={"include_stop_str_in_output": True}, **kw).choices[0]
    assert kept.text == line.text + "\n" and line.finish_reason == "stop"
    first_line = len(engine.tokenizer.encode(kept.text, add_special_tokens=False))
    late = client.completions.create(stop=["\n"], extra_body={"min_tokens": first_line}, **kw).choices[0]
    assert late.text.startswith(kept.text) and late.text.count("\n") == 1  # no stop within min_tokens
    # the end-of-sequence token's text appears only when special tokens are kept and the stop token is included
    answer = dict(kw, prompt=QUESTION.replace("*55", "*40"), max_tokens=470)  # 40 lines of reasoning fit
    eos = {"skip_special_tokens": False, "include_stop_str_in_output": True, "spaces_between_special_tokens": False}
    full = client.completions.create(extra_body=eos, **answer).choices[0]
    assert full.finish_reason == "stop" and full.text.endswith("}<|im_end|>")
    assert client.completions.create(**answer).choices[0].text == full.text[:-len("<|im_end|>")]
    ids = engine.tokenizer.encode(QUESTION, add_special_tokens=False)
    short = client.completions.create(extra_body={"truncate_prompt_tokens": 12}, **kw)
    want, _ = offline(reference, ids[-12:], temperature=0.0, max_tokens=60)
    assert short.usage.prompt_tokens == 12 and short.choices[0].text == want.text
    # chat: continue the assistant's own message and echo it; template variables pass through
    messages = [{"role": "user", "content": "What is 67815*55?"}, {"role": "assistant", "content": "01:5187"}]
    got = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=20,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                     "echo": True, "chat_template_kwargs": {"enable_thinking": False}})
    prompt = engine.get_tokenizer().apply_chat_template(messages, continue_final_message=True, tokenize=False)
    want, _ = offline(reference, prompt, temperature=0.0, max_tokens=20)
    assert got.choices[0].message.content == "01:5187" + want.text and want.text.startswith("600\n")
    tokens = client.completions.create(logprobs=0, extra_body={"return_tokens_as_token_ids": True},
                                       **{**kw, "max_tokens": 3}).choices[0].logprobs.tokens
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens)


def think_tags(parser: str, split: int):
    """Rewrite a reply's cumulative text as a reasoning model would write it: the first ``split`` characters
    thought inside <think>...</think> (qwen3 opens the tag itself; a deepseek_r1 template opens it in the prompt)."""
    def rewrite(text):
        head = "<think>" if parser == "qwen3" else ""
        return head + text[:split] + ("</think>" + text[split:] if len(text) > split else "")
    return rewrite


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_parser_returns_the_think_block_as_reasoning_content(reference, model, parser):
    messages = [{"role": "user", "content": "What is 67815*55?"}]
    want, _ = offline(reference, chat_ids(reference, messages), temperature=0.0, max_tokens=40)
    split, rewrite = 25, think_tags(parser, 25)
    real_step = reference.step

    def thinking_step(*args, **kwargs):  # the loop thread's engine writes its replies with think tags
        outputs = real_step(*args, **kwargs)
        for out in outputs:
            out.outputs[0].text = rewrite(out.outputs[0].text)
        return outputs

    reference.step = thinking_step
    try:
        with live_server(reference, reasoning_parser=parser) as server:
            client = server.client()
            kw = dict(model=model, messages=messages, temperature=0, max_tokens=40)
            message = client.chat.completions.create(**kw).choices[0].message
            assert message.reasoning_content == want.text[:split] and message.content == want.text[split:]
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta if chunk.choices else None
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += (delta.content or "") if delta else ""
            assert (reasoning, content) == (want.text[:split], want.text[split:])
            hidden = client.chat.completions.create(extra_body={"include_reasoning": False}, **kw).choices[0].message
            assert hidden.reasoning_content is None and hidden.content == want.text[split:]
    finally:
        del reference.step
    with pytest.raises(ValueError, match="reasoning_parser"):
        create_app(reference, reasoning_parser="other")
    assert build_parser().parse_args(["--reasoning-parser", parser]).reasoning_parser == parser


# -- concurrency, cancellation, back-pressure -------------------------------------------------------------------
def test_64_concurrent_streams_complete_and_cancelled_half_free_their_pages(live, model, engine, reference):
    prompts = [f"client {i}: {'ab' * (i % 5)} ✓" for i in range(64)]
    # the oracle of the streams that run to the end (even i); the odd ones are cancelled after their first text
    wants = dict(zip(range(0, 64, 2), (want.text for want in offline_batch(reference, prompts[::2], temperature=0.0,
                                                                               max_tokens=48))))
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "an idle server")
    before = live.metrics()
    baseline_pages = before["zipage:kv_pages_used"]
    threads, real_step = set(), engine.step

    def recording_step(*args, **kwargs):  # who touches the engine while 64 clients hammer the server
        threads.add(threading.current_thread().name)
        return real_step(*args, **kwargs)

    engine.step = recording_step

    after = stream_all_cancelling_odd(live, model, prompts, wants, max_tokens=48, cancel_max_tokens=400)
    assert after["zipage:kv_pages_used"] == baseline_pages
    assert after["zipage:server_client_aborts_total"] - before["zipage:server_client_aborts_total"] == 32
    del engine.step
    assert threads == {"engine-loop"}, "the engine must only be touched from its loop thread"


def test_non_streaming_client_disconnect_aborts_the_request(live, model):
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "an idle server")
    before, baseline = (live.metrics()[k] for k in ("zipage:server_client_aborts_total", "zipage:kv_pages_used"))
    body = json.dumps({"model": model, "prompt": "long", "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:  # a client that goes away mid-request
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 1, "the request to be admitted")
    wait_until(lambda: live.metrics()["zipage:server_client_aborts_total"] == before + 1, "the abort")
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "the request to close")
    wait_until(lambda: live.metrics()["vllm:num_requests_running"] == 0, "the batch to drain")
    assert live.metrics()["zipage:kv_pages_used"] == baseline


def test_full_queue_answers_429_and_recovers():
    with live_server(make_engine(max_num_seqs=1), max_queued_requests=1) as live:
        client, model = live.client(), model_of(live)
        kw = dict(model=model, prompt="hold", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        held = [client.completions.create(**kw) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=model, prompt="one more", max_tokens=2)
        assert err.value.status_code == 429 and "queue is full" in err.value.message
        assert err.value.body["code"] == "queue_full"
        with pytest.raises(openai.BadRequestError, match="capacity"):
            client.completions.create(model=model, prompt="too many", n=3, max_tokens=2)
        for stream in held:
            stream.close()
        wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "capacity to return")
        assert client.completions.create(model=model, prompt="now", max_tokens=2).choices[0].text
        assert live.metrics()["zipage:server_rejected_total"] == 1


def test_engine_step_failure_fails_in_flight_requests_and_the_loop_survives(live, model, engine, reference):
    client = live.client()
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "an idle server")
    before = live.metrics()
    real_step, failures = engine.step, []

    def failing_step():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected device fault")
        return real_step()

    engine.step = failing_step
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=model, prompt="doomed", max_tokens=50)
        assert err.value.body["type"] == "internal_error"
        engine.step = real_step
        assert live.get("/health").status_code == 200
        got = client.completions.create(model=model, prompt="fine", max_tokens=50, temperature=0)
        assert got.choices[0].text == offline(reference, "fine", temperature=0.0, max_tokens=50)[0].text
        wait_until(lambda: live.metrics()["vllm:num_requests_running"] == 0, "the batch to drain")
        after = live.metrics()
        assert after["zipage:kv_pages_used"] == before["zipage:kv_pages_used"]
        assert after["zipage:server_step_failures_total"] == before["zipage:server_step_failures_total"] + 1

        engine.step, failures = failing_step, []
        with pytest.raises(openai.APIError, match="engine failed"):
            for _ in client.completions.create(model=model, prompt="doomed", max_tokens=50, stream=True):
                pass
    finally:
        del engine.step


def test_graceful_shutdown_aborts_in_flight_and_joins_the_loop(reference):
    def loop_threads():
        return sum(t.name == "engine-loop" for t in threading.enumerate())

    engine, before = reference, loop_threads()
    with live_server(engine, grace_s=0.2) as live:
        assert loop_threads() == before + 1
        baseline = live.metrics()["zipage:kv_pages_used"]
        client, model = live.client(), model_of(live)
        stream = client.completions.create(model=model, prompt="forever", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        live.stop()
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            for _ in stream:
                pass
        assert loop_threads() == before, "the engine loop thread must be joined"
        assert not engine.has_unfinished_requests()
        assert engine.metrics()["kv_pages_used"] == baseline


# -- errors -----------------------------------------------------------------------------------------------------
def _completion(**kw):
    return {"model": "MODEL", "prompt": "hi", "max_tokens": 4, **kw}


def _chat(**kw):
    return {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], **kw}


BAD_REQUESTS = [  # (path, body, status, param or None, message fragment)
    ("/v1/completions", b"{not json", 400, None, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", b"", 400, None, ""),
    ("/v1/completions", _completion(model=7), 400, "model", "model"),
    ("/v1/completions", _completion(prompt="a\ud800b"), 400, "prompt", "prompt: invalid Unicode"),
    ("/v1/completions", _completion(prompt=["ok", "\udfff"]), 400, "prompt", "prompt[1]: invalid Unicode"),
    ("/v1/completions", _completion(stop=["ok", "\ud800"]), 400, "stop", "stop[1]: invalid Unicode"),
    ("/v1/completions", _completion(user="\ud800"), 400, "user", "invalid Unicode"),
    ("/v1/completions", _completion(model="no-such-model"), 404, "model", "does not exist"),
    ("/v1/completions", _completion(temperature="hot"), 400, "temperature", "temperature"),
    ("/v1/completions", _completion(temperature=-1), 400, "temperature", "temperature"),
    ("/v1/completions", _completion(top_p=0), 400, "top_p", "top_p"),
    ("/v1/completions", _completion(n=0), 400, "n", "n"),
    ("/v1/completions", _completion(n=10_000), 400, "n", "n"),
    ("/v1/completions", _completion(max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", _completion(min_tokens=9), 400, "min_tokens", "min_tokens"),
    ("/v1/completions", _completion(stop=[""]), 400, "stop", "stop"),
    ("/v1/completions", _completion(seed=2**70), 400, "seed", "seed"),
    ("/v1/completions", _completion(logprobs=21), 400, "logprobs", "logprobs"),
    ("/v1/completions", _completion(prompt_logprobs=-1), 400, "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", _completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens", "truncate_prompt"),
    ("/v1/completions", _completion(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
    ("/v1/completions", _completion(stream=True, prompt_logprobs=1), 400, "prompt_logprobs", "stream"),
    ("/v1/completions", _completion(allowed_token_ids=[5]), 400, "allowed_token_ids", "not supported"),
    ("/v1/completions", _completion(use_beam_search=True), 400, "use_beam_search", "not supported"),
    ("/v1/completions", _completion(best_of=3), 400, "best_of", "not supported"),
    ("/v1/completions", _completion(structural_tag='{"x": 1}'), 400, "structural_tag", "not supported"),
    ("/v1/completions", _completion(prompt=""), 400, "prompt", "empty"),
    ("/v1/completions", _completion(prompt=[]), 400, "prompt", "empty"),
    ("/v1/completions", _completion(prompt=[10**6]), 400, "prompt", "token ids"),
    ("/v1/completions", _completion(prompt="FULL_CONTEXT"), 400, "prompt", "maximum context length"),
    ("/v1/completions", _completion(prompt="HALF_CONTEXT", max_tokens="HALF_CONTEXT+1"), 400, "max_tokens",
     "'max_tokens' or 'max_completion_tokens' is too large"),
    ("/v1/chat/completions", _chat(max_completion_tokens="FULL_CONTEXT_TOKENS"), 400, "max_tokens",
     "maximum context length"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages", "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages",
     "messages[0].content: invalid Unicode"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
     400, "messages", "messages[0].content[0].text: invalid Unicode"),
    ("/v1/chat/completions", _chat(stop="\udc00", chat_template_kwargs={"x\ud800": 1}), 400, "stop",
     "invalid Unicode"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages", "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages", "messages"),
    ("/v1/chat/completions", _chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", _chat(top_logprobs=3), 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", _chat(logprobs=1), 400, "logprobs", "logprobs"),
    ("/v1/chat/completions", _chat(functions=[{"name": "f"}]), 400, "functions", "not supported"),
    ("/v1/chat/completions", _chat(bad_words=["x"]), 400, "bad_words", "not supported"),
    ("/v1/chat/completions", _chat(continue_final_message=True), 400, "continue_final_message",
     "add_generation_prompt"),
    ("/v1/chat/completions", _chat(model="other"), 404, "model", "does not exist"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_REQUESTS)
def test_bad_input_gets_a_4xx_in_openai_error_shape(live, model, engine, path, body, status, param, fragment):
    if isinstance(body, dict):
        half, token = engine.max_model_len // 2, engine.tokenizer.encode("y", add_special_tokens=False)[0]
        fill = {"MODEL": model, "FULL_CONTEXT": [token] * engine.max_model_len, "HALF_CONTEXT": [token] * half,
                "HALF_CONTEXT+1": engine.max_model_len - half + 1, "FULL_CONTEXT_TOKENS": engine.max_model_len}
        body = json.dumps({k: fill.get(v, v) if isinstance(v, str) else v for k, v in body.items()}).encode()
    r = live.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_unknown_route_and_method_use_the_error_shape(live):
    r = live.get("/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = live.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert live.get("/v1/models/not-it").status_code == 404


def test_api_key_is_checked_before_the_body_and_several_names_are_served(reference):
    with live_server(reference, api_key="s3cret", served_model_name=["tiny", "alias"]) as live:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = live.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        json_type = {"content-type": "application/json"}
        assert live.post("/v1/completions", content=b"{not json", headers=json_type).status_code == 401  # as vLLM
        r = live.post("/v1/completions", content=b"{not json", headers={**json_type, "Authorization": "Bearer s3cret"})
        assert r.json()["error"]["code"] == "invalid_json"
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").completions.create(model="fake", prompt="x")
        client = live.client(api_key="s3cret")
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        got = client.completions.create(model="alias", prompt="ok", max_tokens=2)
        assert got.model == "tiny" and got.choices  # responses name the first served name, as vLLM's
        body = {"prompt": "ok", "max_tokens": 2}  # no model: the served one (vLLM)
        r = live.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert live.get("/health").status_code == 200 and live.post("/tokenize", json=body).status_code == 200


def test_an_unexpected_error_is_one_traceback_and_a_500(live, model, caplog, monkeypatch):
    async def broken(self, body, request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(OpenAIServingCompletion, "create", broken)
    uvicorn_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR):
            r = live.post("/v1/completions", json=_completion(model=model))
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert [record.exc_info[1].args for record in caplog.records if record.exc_info] == [("a bug",)]


def test_half_open_connections_are_closed(reference):
    """Connections that never finish their headers, or never send the body they announced, are closed once the
    read timeout passes (a body that never comes gets a 408 first); the server serves on."""
    with live_server(reference, read_timeout=0.2) as live:
        host, port = live.url.removeprefix("http://").split(":")
        headers = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
        kinds = {"silent": b"", "unfinished headers": headers,
                 "no body": headers + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"}
        sockets = {kind: [socket.create_connection((host, int(port))) for _ in range(10)] for kind in kinds}
        for kind, group in sockets.items():
            for sock in group:
                sock.sendall(kinds[kind])
        for kind, group in sockets.items():
            for sock in group:
                sock.settimeout(HANG_S)
                received = b""
                while chunk := sock.recv(65536):  # until the server closes it
                    received += chunk
                sock.close()
                assert received.startswith(b"HTTP/1.1 408") if kind == "no body" else received == b"", kind
        assert live.get("/health").status_code == 200


# -- observability ----------------------------------------------------------------------------------------------
def test_models_health_ping_version_and_openapi(live, model, engine):
    client = live.client()
    assert [m.id for m in client.models.list().data] == [engine.model_name] == [model] == ["tiny-reasoner"]
    assert client.models.retrieve(model).id == model
    assert live.get("/health").json() == {"status": "ok"}
    assert (live.get("/ping").status_code, live.post("/ping").status_code) == (200, 200)
    assert live.get("/version").json() == {"version": importlib.metadata.version("zipage_jax")}
    schema = live.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
            "/health", "/ping", "/version", "/metrics"} <= set(schema["paths"])
    assert "kv_budget_pages" in schema["components"]["schemas"]["CompletionRequest"]["properties"]


def test_tokenizer_endpoints_answer_in_vllm_shapes(live, model, engine):
    """The oracle is transformers' tokenizer of the model, beside the server's own path."""
    hf = engine.get_tokenizer()
    got = live.post("/tokenize", json={"model": model, "prompt": QUESTION}).json()
    ids = hf.encode(QUESTION)
    assert got == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    got = live.post("/tokenize", json={"prompt": QUESTION, "add_special_tokens": False, "return_token_strs": True})
    assert got.json()["token_strs"] == hf.convert_ids_to_tokens(hf.encode(QUESTION, add_special_tokens=False))
    messages = [{"role": "user", "content": "What is 67815*55?"}]
    assert live.post("/tokenize", json={"messages": messages}).json()["tokens"] == chat_ids(engine, messages)
    plain = hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    got = live.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert got == hf.encode(plain, add_special_tokens=False)
    assert live.post("/detokenize", json={"model": model, "tokens": ids}).json() == {"prompt": hf.decode(ids)}
    for path, body, param in [("/detokenize", {"tokens": [len(hf)]}, "tokens"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages")]:
        r = live.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    info = live.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(hf).__name__ and info["eos_token"] == hf.eos_token
    assert info["chat_template"] == hf.chat_template and "vocab_file" not in info


def test_generation_config_defaults_the_server_chat_template_and_max_logprobs(reference, tmp_path):
    """vLLM's --generation-config DIR (sampling defaults for what a request leaves unset), --chat-template (the
    server's own template, for chat and /tokenize) and --max-logprobs."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 9}))
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "What is 67815*55?"}]
    prompt = "<|im_start|>What is 67815*55?"
    with live_server(reference, generation_config=str(tmp_path), chat_template=template, max_logprobs=2) as live:
        client, model = live.client(), model_of(live)
        want, _ = offline(reference, prompt, temperature=0.0, max_tokens=9, ignore_eos=True)
        got = client.chat.completions.create(model=model, messages=messages, extra_body={"ignore_eos": True})
        assert (got.choices[0].message.content, got.usage.completion_tokens) == (want.text, 9)
        ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
        assert live.post("/tokenize", json={"messages": messages}).json()["tokens"] == ids
        with pytest.raises(openai.BadRequestError, match="--max-logprobs of 2"):
            client.completions.create(model=model, prompt="x", max_tokens=2, logprobs=3)
    assert sampling_defaults("vllm", str(tmp_path)) == {}
    assert sampling_defaults("auto", str(tmp_path), {"top_k": 5}) == {"temperature": 0.0, "max_tokens": 9, "top_k": 5}
    with pytest.raises(ValueError, match="override_generation_config"):
        sampling_defaults("vllm", None, {"best_of": 2})
    with pytest.raises(ValueError, match="generation_config: its defaults are invalid"):
        sampling_defaults("vllm", None, {"temperature": -1})


def test_metrics_parse_with_prometheus_client_and_the_histograms_move_with_traffic(live, model, engine):
    """vLLM's names, types and labels; one request moves each request histogram by exactly what it did (its usage
    is the oracle), its time to first token within its end-to-end latency."""
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "an idle server")
    r = live.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram", "zipage:compressions": "counter",
             "zipage:evicted_tokens": "counter", "zipage:request_kv_pages": "histogram",
             "zipage:server_responses": "counter"}
    assert {name: families[name].type for name in kinds} == kinds
    assert families["vllm:num_requests_running"].samples[0].labels == {"model_name": model, "engine": "0"}
    assert families["zipage:compression_time_share"].samples[0].value == 0.0  # compression off: measured, none
    dashboard = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "grafana-dashboard.json").read_text())
    read = {re.sub(r"_(bucket|total|sum|count)$", "", name) for panel in dashboard["panels"]
            for target in panel["targets"] for name in re.findall(r"(?:vllm|zipage):\w+", target["expr"])}
    assert read <= set(families)  # the dashboard reads what the server exports
    counters = dict(requests_in_flight=0, request_capacity=1, client_aborts=0, rejected=0, step_failures=0,
                    responses={})
    unmeasured, _ = ServerMetrics("m", 64, 5, lambda: ({"compression_time_share": None, "num_running": 2},
                                                       counters)).render(None)
    assert "compression_time_share" not in unmeasured.decode()  # asynchronous, unobserved: absent, not made up
    before = live.metrics()
    got = live.client().completions.create(model=model, prompt=QUESTION, temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True})
    wait_until(lambda: live.metrics()["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"],
               "the engine's counters to be published")
    after = live.metrics()

    def moved(name):
        return after[name] - before[name]

    n = got.usage.completion_tokens
    assert n == 12 and moved('vllm:request_success_total{finished_reason="length"}') == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens", "zipage:request_kv_pages"):
        assert moved(f"{name}_count") == 1, name
    assert moved("vllm:inter_token_latency_seconds_count") == n - 1  # one token a step after the first
    assert moved("vllm:request_prompt_tokens_sum") == got.usage.prompt_tokens
    assert moved("vllm:request_generation_tokens_sum") == n
    assert 0 < moved("vllm:time_to_first_token_seconds_sum") <= moved("vllm:e2e_request_latency_seconds_sum")
    assert moved('vllm:e2e_request_latency_seconds_bucket{le="+Inf"}') == 1
    assert moved("zipage:evicted_tokens_total") == 0  # compression is off


def test_schemathesis_finds_no_server_error(live, model):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            if isinstance(case.body, dict) and case.path.startswith("/v1/"):
                if "model" in case.body:  # optional (vLLM): left out, the served one
                    case.body["model"] = model  # reach the engine, not just the unknown-model 404
                # short generations: the point is the server's answers, and a default max_tokens is the whole
                # context (hundreds of CPU decode steps per case, past the client's timeout on a busy machine)
                for key in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(key), int) and case.body[key] > 16:
                        case.body[key] = 16
                if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
                    case.body["max_tokens"] = 16
            response = case.call(base_url=live.url, timeout=HANG_S)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text))

        check()
    assert not failures, failures[:3]


def test_health_says_starting_during_warmup_and_ok_once_ready():
    """/health answers 503 "starting" while the loop thread compiles, requests get a 503, then both work."""
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64,  # 6 programs: a quick warm-up
                         compilation_cache_dir=None)  # compiled here, not loaded
    release, compiling = threading.Event(), threading.Event()
    real_warmup = engine.warmup

    def slow_warmup(progress=None, stop=None, ready_early=False):
        compiling.set()
        assert release.wait(HANG_S)
        return real_warmup(progress, stop, ready_early)

    engine.warmup = slow_warmup
    with live_server(engine, warmup=True) as live:
        assert compiling.wait(HANG_S)
        health = live.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        refused = live.post("/v1/completions", json={"model": "tiny-reasoner", "prompt": "1+1"})
        assert refused.status_code == 503 and "starting" in refused.json()["error"]["message"]
        release.set()
        wait_until(lambda: live.get("/health").status_code == 200, "the server to be ready")
        assert live.get("/health").json() == {"status": "ok"}
        done = live.client().completions.create(model="tiny-reasoner", prompt="1+1", max_tokens=3, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop")
        assert engine.metrics()["num_compiles"] > 0


def test_ready_early_serves_while_the_rest_compiles_in_the_background(monkeypatch):
    """With ``ready_early`` /health is 200 once a light load's programs are compiled and says the rest compile in
    the background; requests are served meanwhile, within the compiled buckets (no compile waited on); when the
    background is done /health says plain ok."""
    held = []
    monkeypatch.setattr(Programs, "compile_in_background", lambda *args, **kwargs: held.append((args, kwargs)))
    engine = make_engine()  # its programs mostly load from the module's store: compiled or loaded, all the same
    with live_server(engine, warmup=True, ready_early=True) as live:
        wait_until(lambda: live.get("/health").status_code == 200, "the server to be ready")
        assert held and "background" in live.get("/health").json()["detail"]
        prompts = ["1+1", "12+30", "7+8+9", "100+23"] * 3  # 12 requests: more than the 8 rows compiled
        done = live.client().completions.create(model="tiny-reasoner", prompt=prompts, max_tokens=4, temperature=0)
        assert len(done.choices) == 12 and engine.metrics()["num_compiles_waited_on"] == 0
        held[0][1]["done"]()  # the background's end (its compiles: tests/test_compression_engine.py)
        wait_until(lambda: live.get("/health").json() == {"status": "ok"}, "the background compiles to be reported")
