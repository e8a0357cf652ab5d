"""End-to-end engine behaviour on tiny random HF checkpoints (CPU, reference attention)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import checkpoint_params, mixed_workload, padded_dense_logits
from zipage_jax import LLM, SamplingParams, StructuredOutputsParams
from zipage_jax.sampling_params import completion_budget
from zipage_jax.worker.worker import Executor
from seeds import fresh_seed, seeded_rng
from waiting import HANG_S

FIXTURES = "tests/fixtures/hf"
NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(name="qwen3", **kwargs):
    opts = dict(page_size=16, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=160,
                compilation_cache_dir=None)
    opts.update(kwargs)
    return LLM(f"{FIXTURES}/{name}", **opts)


def random_prompts(rng, count, lo=3, hi=40, vocab=250):
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def dense_greedy_predictions(llm, prompts, outputs):
    """Teacher-forced oracle: the dense (cache-free) forward's argmax at every output position; equal to
    ``outputs[i]`` exactly when it is the greedy continuation of ``prompts[i]``."""
    engine = llm.engine
    rows = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    logits = padded_dense_logits(checkpoint_params(engine), engine.model_cfg, rows)
    return [jnp.argmax(logits[i, len(p) - 1:len(r) - 1], axis=-1).tolist()
            for i, (p, r) in enumerate(zip(prompts, rows))]


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "qwen2", "qwen3", "qwen3_untied"])
def test_greedy_matches_hf(name, request):
    """Engine greedy == HF greedy token for token, up to the first genuine logit near-tie."""
    expected = np.load(f"{FIXTURES}/{name}/expected.npz")
    llm = request.getfixturevalue("llm") if name == "qwen3" else make_llm(name)  # the module's engine is qwen3's
    prompts = [p[:n].tolist() for p, n in zip(expected["prompt_ids"], expected["prompt_lens"])]
    steps = expected["greedy_ids"].shape[1]
    outs = token_ids(llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=steps), use_tqdm=False))
    compared = ties = 0
    for got, want, margins in zip(outs, expected["greedy_ids"], expected["greedy_margins"]):
        for t in range(steps):
            if margins[t] < NEAR_TIE:
                ties += 1
                break
            assert got[t] == want[t], f"{name}: step {t}: {got} vs HF {want.tolist()}"
            compared += 1
    assert ties <= 1 and compared >= steps * len(prompts) - steps


def test_greedy_matches_dense_oracle(llm):
    rng = seeded_rng()
    prompts = random_prompts(rng, 3)
    outs = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert all(len(got) == GREEDY.max_tokens for got in outs)
    assert outs == dense_greedy_predictions(llm, prompts, outs)


def test_batch_invariance_alone_batched_chunked_and_prefix_hit(llm):
    """Alone (decode bucket 8), batched (12 rows: bucket 16, prefill chunks of 256 tokens), chunked (16-token
    chunks) and beside a prefix-cache hit, a request decodes the same tokens (on the module's engine: the hit rate
    is the one of this test's prompts, from the counters the gauge reads)."""
    rng = seeded_rng()
    prefix = rng.integers(3, 250, size=37).tolist()
    prompts = [prefix + p for p in random_prompts(rng, 11, lo=1, hi=30)] + [prefix]
    pages = llm.engine.scheduler.page_manager
    before = pages.prefix_hits, pages.prefix_queries
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:3]]
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert batched[:3] == alone
    assert llm.metrics()["prefix_cache_hit_rate"] == pages.prefix_hits / pages.prefix_queries
    hits, queries = pages.prefix_hits - before[0], pages.prefix_queries - before[1]
    assert hits / queries > 0.3  # the shared 37-token prefix = 2 full pages
    hits = [o.metrics["num_cached_tokens"] for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)]
    assert all(h >= 32 for h in hits)
    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == batched


def test_seeded_sampling_is_reproducible_across_batches(llm):
    rng = seeded_rng()
    prompts = random_prompts(rng, 6)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = token_ids(llm.generate([prompts[2]], params, use_tqdm=False))[0]
    batch = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert batch[2] == alone
    unseeded = dataclasses.replace(params, seed=None)
    a, b = token_ids(llm.generate([prompts[0]] * 2, unseeded, use_tqdm=False))
    assert a != b  # distinct engine seeds per request


def test_preemption_by_recompute_is_lossless(llm):
    rng = seeded_rng()
    prompts = random_prompts(rng, 8, lo=20, hi=40)
    params = dataclasses.replace(GREEDY, max_tokens=30)
    roomy = token_ids(llm.generate(prompts, params, use_tqdm=False))  # the module's engine has room for all
    tight = make_llm(num_gpu_pages_override=12)  # 11 usable pages; each request needs up to 5
    assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == roomy
    assert tight.metrics()["num_preempted"] > 0


def test_stops_max_tokens_and_logprobs(llm):
    rng = seeded_rng()
    prompt = random_prompts(rng, 1)[0]
    free = llm.generate([prompt], dataclasses.replace(GREEDY, logprobs=True), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == GREEDY.max_tokens
    assert len(free.logprobs) == len(free.token_ids)
    assert all(list(e) == [t] and e[t].logprob <= 0 and e[t].rank == 1 for t, e in zip(free.token_ids, free.logprobs))
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate([prompt], dataclasses.replace(GREEDY, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == free.token_ids[:first + 1]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    by_str = llm.generate([prompt], dataclasses.replace(GREEDY, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.text == text[:text.index(stop)]


@pytest.mark.parametrize("prompt_len,max_tokens,capped", [(20, None, 44), (20, 44, 44), (20, 45, 44), (20, 10**6, 44),
                                                         (20, 7, 7), (63, 5, 1)])
def test_max_tokens_follows_vllms_rule(prompt_len, max_tokens, capped):
    """vLLM's rule, one function for both APIs: without max_tokens a request may fill the context; beyond it,
    the offline API caps it (generation ends at max_model_len, finish reason "length") and the server refuses it
    naming max_tokens with vLLM's message (its 400 is tested with the server)."""
    assert completion_budget(prompt_len, max_tokens, 64, reject=False) == capped
    if max_tokens is not None and max_tokens > 64 - prompt_len:
        with pytest.raises(ValueError, match=rf"^max_tokens: 'max_tokens' or 'max_completion_tokens' is too large: "
                                             rf"{max_tokens}\. This model's maximum context length is 64 tokens and "
                                             rf"your request has {prompt_len} input tokens"):
            completion_budget(prompt_len, max_tokens, 64, reject=True)
    else:
        assert completion_budget(prompt_len, max_tokens, 64, reject=True) == capped
    for too_long in (64, 65):
        for reject in (False, True):
            with pytest.raises(ValueError, match="^prompt: This model's maximum context length is 64 tokens"):
                completion_budget(too_long, max_tokens, 64, reject=reject)


def test_a_max_tokens_beyond_the_context_runs_to_the_context(llm):
    engine, prompt = llm.engine, random_prompts(seeded_rng(), 1, lo=30, hi=40)[0]
    [out] = llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=10**6), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt) + len(out.outputs[0].token_ids) == engine.max_model_len == 160


def test_the_engine_resolves_max_tokens_and_truncation_once(llm):
    """``max_tokens=None`` fills the context; ``reject_over_length`` (the server's rule) refuses what the offline
    API caps; the request as queued holds the truncated prompt and the resolved budget."""
    engine, prompt = llm.engine, random_prompts(seeded_rng(), 1, lo=30, hi=40)[0]
    engine.add_request("none", prompt, dataclasses.replace(GREEDY, max_tokens=None, truncate_prompt_tokens=20))
    queued = engine.requests["none"]
    assert queued.prompt_token_ids == prompt[-20:] and queued.sampling_params.max_tokens == 160 - 20
    with pytest.raises(ValueError, match="^max_tokens: 'max_tokens' or 'max_completion_tokens' is too large"):
        engine.add_request("over", prompt, dataclasses.replace(GREEDY, max_tokens=10**6), reject_over_length=True)
    assert "over" not in engine.requests
    engine.abort_request("none")
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_inputs_raise_and_engine_keeps_serving(llm):
    rng = seeded_rng()
    engine = llm.engine
    engine.add_request("keep", random_prompts(rng, 1)[0], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("long", [5] * 200, GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("vocab", [5, 10_000], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("keep", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match="bogus"):
        make_llm(bogus=1)
    with pytest.raises(ValueError, match="page_size"):
        make_llm(page_size=24)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["keep"] and len(finished["keep"].outputs[0].token_ids) == GREEDY.max_tokens


def test_every_step_donates_the_whole_device_state(llm):
    """Pools, caches and token buffer travel as one donated pytree: after a prefill and a decode step the state
    they were given is gone (updated in place), the fields a step leaves alone included."""
    engine = llm.engine
    assert isinstance(engine.worker, Executor)  # the whole protocol the step loop is written against
    engine.add_request("donate", [5, 6, 7], dataclasses.replace(GREEDY, max_tokens=3))
    kinds = []
    while engine.has_unfinished_requests():
        before = jax.tree.leaves(engine.worker.state)
        engine.step()
        if engine._in_flight:
            kinds += [handle.kind for handle in engine._in_flight]
            assert all(leaf.is_deleted() for leaf in before), kinds
    assert {"prefill", "decode"} <= set(kinds)


def test_abort_frees_pages(llm):
    rng = seeded_rng()
    engine = llm.engine
    for i, p in enumerate(random_prompts(rng, 4)):
        engine.add_request(f"abort-{i}", p, dataclasses.replace(GREEDY, max_tokens=100))
    for _ in range(3):
        engine.step()
    assert engine.metrics()["kv_pages_used"] > 0
    for i in range(4):
        engine.abort_request(f"abort-{i}")
    reasons = {}
    while engine.has_unfinished_requests():
        reasons.update({o.request_id: o.outputs[0].finish_reason for o in engine.step() if o.finished})
    assert set(reasons.values()) == {"abort"} and len(reasons) == 4
    assert engine.metrics()["kv_pages_used"] == 0


# docs/ARCHITECTURE.md: 6 decode batch sizes (8 ... 256) x greedy / sampled, 5 prefill token counts (128 ... 2048),
# the prompt-logprobs program and 3 structured-output mask writes (16, 64, 256 rows)
DEFAULT_CONFIG_PROGRAMS = 21


def test_default_config_warms_up_its_programs_and_a_mixed_workload_compiles_nothing():
    llm = LLM(compilation_cache_dir=None)  # the shipped model, every engine option at its default
    before = llm.metrics()["num_compiles"]
    report = llm.warmup(use_tqdm=False)
    assert report["programs"] == DEFAULT_CONFIG_PROGRAMS
    assert llm.metrics()["num_compiles"] - before == DEFAULT_CONFIG_PROGRAMS
    seed = fresh_seed()
    prompts, params = mixed_workload(np.random.default_rng(seed), llm.engine.model_cfg.vocab_size, 8, 200)
    prompts.append("12+7=")  # and a constrained request
    params.append(SamplingParams(temperature=0.8, seed=seed, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[-1].outputs[0].text in ("yes", "no")
    assert all(len(c.token_ids) >= 1 for o in outs for c in o.outputs), seed
    assert llm.metrics()["num_compiles"] - before == DEFAULT_CONFIG_PROGRAMS, seed

def test_chat_and_generate_reject_bad_input_and_an_empty_batch_prints_nothing(llm, capsys):
    with pytest.raises(ValueError, match="^chat_template"):  # this fixture's tokenizer has no template
        llm.chat([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for bad in ([], "hi", [[{"role": "user"}]], [{"content": "no role"}]):
        with pytest.raises(ValueError, match="^messages"):
            llm.chat(bad, chat_template=template)
    one = llm.chat([{"role": "user", "content": "a b c"}], GREEDY, chat_template=template, use_tqdm=False)
    assert one[0].outputs[0].token_ids == llm.generate(["a b c"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    capsys.readouterr()
    assert llm.generate([]) == [] and capsys.readouterr().err == ""


def test_quiet_start_and_long_prompts(llm, caplog):
    """No advice to install PyTorch (the engine needs only tokenizers) and no tokenizer length warning: the
    engine checks prompt lengths against max_model_len itself."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "import zipage_jax; import transformers; transformers.AutoConfig"],
                         capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0 and "PyTorch was not found" not in run.stderr + run.stdout
    with caplog.at_level("WARNING"):
        ids = llm.tokenizer.encode(" ".join(["a"] * 5000), add_special_tokens=False)
    assert len(ids) >= 5000 and not [r for r in caplog.records if "sequence length" in r.getMessage()]


def test_a_model_directory_without_a_tokenizer_is_a_value_error_at_once(tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(f"{FIXTURES}/qwen3", model, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match="^model: no tokenizer in .*; name one with tokenizer"):
        LLM(str(model), compilation_cache_dir=None)
    with pytest.raises(ValueError, match="^tokenizer: no tokenizer in"):
        LLM(f"{FIXTURES}/qwen3", tokenizer=str(model), compilation_cache_dir=None)


def test_the_tokenizer_loads_beside_the_start_and_adds_its_end_of_sequence(tmp_path):
    """The tokenizer loads beside the pool, the weights and the warm-up; its end-of-sequence token joins the
    engine's (and the worker's, whose sampling bans it below ``min_tokens``) only once it is there, and the first use
    waits for it."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(f"{FIXTURES}/qwen3", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    llm = LLM(str(model), page_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
              compilation_cache_dir=None)
    engine = llm.engine
    assert engine.eos_token_ids == (5,) and engine.worker.layout.eos_token_ids == (5,)  # the config's alone, so far
    assert engine.tokenizer.eos_token_id == 2
    assert engine.eos_token_ids == (2, 5) and engine.worker.layout.eos_token_ids == (2, 5)


@pytest.mark.usefixtures("without_jax_cache")  # it starts on an executable store
def test_weights_made_by_a_function_come_after_the_pool_and_serve_alike(tmp_path):
    """``params`` as a function (random weights in the benchmarks) is called once the pool is placed, and its
    weights serve exactly as the same weights handed over made (the second engine loads the first's programs)."""
    from zipage_jax.config import EngineConfig
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.core.request import Request
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.models import weights

    seed = fresh_seed()
    model_cfg = MODEL_SHAPES["tiny"]
    prompt = np.random.default_rng(seed).integers(0, model_cfg.vocab_size, size=21).tolist()
    config = EngineConfig.from_kwargs("random:tiny", page_size=16, max_model_len=64, max_num_seqs=2,
                                      max_num_batched_tokens=64, num_gpu_pages_override=12,
                                      attention_backend="reference", compilation_cache_dir=str(tmp_path))
    make = lambda: weights.init_random_params(model_cfg, jax.random.key(seed), jnp.float32)  # noqa: E731
    outputs = []
    for params in (make(), make):
        engine = LLMEngine(config, model_cfg, params)
        request = Request("r", prompt, GREEDY, 0, seed=0)
        engine.add(request)
        while engine.has_unfinished_requests():
            engine.step(only_finished=True)
        outputs.append((request.output_token_ids, "plan_and_pool" in engine.startup_s))
    assert outputs == [(outputs[0][0], False), (outputs[0][0], True)] and len(outputs[0][0]) == 12, f"seed {seed}"
