"""Logprobs: the device's top-k and ranks against numpy; the engine's prompt logprobs against HF transformers on
the shipped model (float32), also under chunked prefill and beside a prefix-cache hit; sampled tokens' top-N
against the dense forward; and the offline SamplingParams fields that shape the text."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import checkpoint_params, padded_dense_logits
from seeds import seeded_rng
from zipage_jax import LLM, SamplingParams
from zipage_jax.layers.logprobs import BLOCK, token_logprobs, top_k

TINY_MODEL = "zipage_jax/assets/tiny-reasoner"
HF_PROMPT_LOGPROBS = "tests/fixtures/tiny_reasoner_prompt_logprobs.npz"  # scripts/make_hf_fixtures.py
NEAR_TIE = 1e-4


def make_llm(**kwargs):
    opts = dict(page_size=16, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, dtype="float32",
                num_gpu_pages_override=256, compilation_cache_dir=None)
    return LLM(TINY_MODEL, **{**opts, **kwargs})


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def hf():
    data = np.load(HF_PROMPT_LOGPROBS)
    prompts = [ids[:n].tolist() for ids, n in zip(data["prompt_ids"], data["prompt_lens"])]
    return prompts, data


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# -- device math --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [7, 100, BLOCK * 20, BLOCK * 20 + 1, 5000])
def test_top_k_is_exact_without_sorting_the_vocabulary(vocab):
    rng = seeded_rng()
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, rng.permutation(vocab)[:3]] = 9.0  # the largest entries in few blocks
    k = min(20, vocab)
    values, ids = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    values, ids = np.asarray(values), np.asarray(ids)
    np.testing.assert_array_equal(values, -np.sort(-x, axis=1)[:, :k])
    np.testing.assert_array_equal(np.take_along_axis(x, ids, axis=1), values)
    assert all(len(set(row)) == k for row in ids.tolist())


def test_token_logprobs_rank_and_alternatives_match_numpy():
    rng = seeded_rng()
    logits = (rng.standard_normal((9, 300)) * 3).astype(np.float32)
    tokens = rng.integers(0, 300, 9).astype(np.int32)
    tokens[0] = logits[0].argmax()
    ids, values = jax.jit(token_logprobs, static_argnums=2)(jnp.asarray(logits), jnp.asarray(tokens), 20)
    ids, values = np.asarray(ids), np.asarray(values)
    lp = np_log_softmax(logits.astype(np.float64))
    rows = np.arange(9)
    np.testing.assert_array_equal(ids[:, 0], tokens)
    np.testing.assert_array_equal(ids[:, 1], 1 + (logits > logits[rows, tokens][:, None]).sum(-1))
    np.testing.assert_allclose(values[:, 0], lp[rows, tokens], atol=1e-5)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :20]
    np.testing.assert_allclose(values[:, 1:], np.take_along_axis(lp, order, 1), atol=1e-5)
    assert values[0, 0] == values[0, 1]  # the most likely token: the same number in both places


# -- prompt logprobs ----------------------------------------------------------------------------------------------
def prompt_logprobs(llm, prompts, num=5, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False)


def test_prompt_logprobs_equal_hf_transformers(llm, hf):
    prompts, data = hf
    outs = prompt_logprobs(llm, prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for t in range(1, len(prompt)):
            entry, token = entries[t], prompt[t]
            assert next(iter(entry)) == token  # the prompt token first, then the alternatives
            assert entry[token].logprob == pytest.approx(float(data["logprobs"][i, t]), abs=1e-3), (i, t)
            hf_top = data["top_logprobs"][i, t]
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:5]
            np.testing.assert_allclose([lp.logprob for _, lp in ranked], hf_top, atol=1e-3)
            if np.all(np.diff(-hf_top) > NEAR_TIE):  # ids compare only where no near-tie could swap them
                assert [tid for tid, _ in ranked] == data["top_ids"][i, t].tolist(), (i, t)
                hf_rank = int(data["ranks"][i, t])
                assert entry[token].rank == hf_rank or hf_rank > 5, (i, t)
            assert all(lp.decoded_token == llm.tokenizer.decode([tid]) for tid, lp in entry.items())


def test_prompt_logprobs_are_the_same_chunked_and_beside_a_prefix_cache_hit(llm, hf):
    prompts, _ = hf
    want = prompt_logprobs(llm, prompts)
    chunked = make_llm(max_num_batched_tokens=32)  # the 190-token prompt takes 6 chunks
    plain = SamplingParams(temperature=0, max_tokens=1)
    assert chunked.generate(prompts, plain, use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    assert chunked.generate(prompts, plain, use_tqdm=False)[0].metrics["num_cached_tokens"] > 0  # cached now
    got = prompt_logprobs(chunked, prompts)
    assert got[0].metrics["num_cached_tokens"] == 0  # a cached page has no logits: the prompt is computed
    for w, g in zip(want, got):
        for we, ge in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert list(we) == list(ge)
            np.testing.assert_allclose([lp.logprob for lp in ge.values()], [lp.logprob for lp in we.values()],
                                       atol=1e-4)
    assert chunked.generate(prompts, plain, use_tqdm=False)[0].metrics["num_cached_tokens"] > 0  # still cached


def test_n_choices_share_the_prompt_logprobs_of_the_first(llm, hf):
    prompts, _ = hf
    out = llm.generate(prompts[1], SamplingParams(n=3, seed=5, max_tokens=4, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(prompts[1])
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])  # 0 alternatives: the token alone


# -- sampled tokens' logprobs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_top_n_logprobs_of_sampled_tokens_match_the_dense_forward(llm, hf, temperature):
    prompts, _ = hf
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=12, logprobs=5, ignore_eos=True)
    engine = llm.engine
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [list(prompt) + out.outputs[0].token_ids for prompt, out in zip(prompts, outs)]
    all_logits = padded_dense_logits(checkpoint_params(engine), engine.model_cfg, rows)
    for prompt, out, ids, logits in zip(prompts, outs, rows, all_logits):
        completion = out.outputs[0]
        oracle = np_log_softmax(np.asarray(logits[:len(ids)], np.float64))[len(prompt) - 1:-1]
        assert len(completion.logprobs) == len(completion.token_ids)
        cumulative = 0.0
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert next(iter(entry)) == token
            own = entry[token]
            assert own.logprob == pytest.approx(oracle[step, token], abs=1e-4)
            assert own.rank == 1 + int((oracle[step] > oracle[step, token] + NEAR_TIE).sum()) or \
                np.any(np.abs(oracle[step] - oracle[step, token]) < NEAR_TIE)
            ranked = sorted(entry.values(), key=lambda lp: lp.rank)
            top = [lp for lp in ranked if lp.rank <= 5][:5]
            assert len(top) == 5 and [lp.rank for lp in top] == [1, 2, 3, 4, 5]
            assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))  # sorted
            np.testing.assert_allclose([lp.logprob for lp in top], -np.sort(-oracle[step])[:5], atol=1e-4)
            if temperature == 0:  # greedy: the sampled token is the most likely, with the identical number
                assert own.rank == 1 and own.logprob == top[0].logprob
            cumulative += own.logprob
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)


# -- SamplingParams fields that shape the text ---------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                                         ("prompt_logprobs", 1.5), ("truncate_prompt_tokens", 0),
                                         ("include_stop_str_in_output", "yes"),
                                         ("spaces_between_special_tokens", 1)])
def test_new_fields_are_validated_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_stop_strings_tokens_min_tokens_and_truncation(llm):
    tok = llm.tokenizer
    prompt = "<|im_start|>user\nWhat is 67815*55?<|im_end|>\n<|im_start|>assistant\n"
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    assert full.startswith("01:") and full.count("\n") >= 3  # the model's reasoning lines

    def text(**kw):
        return llm.generate(prompt, dataclasses.replace(greedy, **kw), use_tqdm=False)[0].outputs[0]

    cut = text(stop=["\n"])
    assert cut.text == full[:full.index("\n")] and cut.stop_reason == "\n"
    assert text(stop=["\n"], include_stop_str_in_output=True).text == full[:full.index("\n") + 1]
    newline = tok.encode("\n", add_special_tokens=False)[0]
    assert text(stop_token_ids=[newline]).text == full[:full.index("\n")]  # the stop token's text is left out
    assert text(stop_token_ids=[newline], include_stop_str_in_output=True).text == full[:full.index("\n") + 1]
    first_line = len(tok.encode(full[:full.index("\n") + 1], add_special_tokens=False))
    # no stop string is looked for within the first min_tokens tokens: the second newline ends it
    late = text(stop=["\n"], min_tokens=first_line)
    assert late.text == full[:full.index("\n", full.index("\n") + 1)]
    ids = tok.encode(prompt, add_special_tokens=False)
    out = llm.generate(prompt, dataclasses.replace(greedy, truncate_prompt_tokens=10, max_tokens=2),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:] and out.prompt == tok.decode(ids[-10:])
