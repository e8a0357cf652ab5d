"""Constrained decoding through the engine: the shipped model's free text is arithmetic, so only the grammar can make
its outputs valid JSON, regex matches or choices. Checked with ``jsonschema`` and ``re``, not against strings; the
unconstrained requests of a batch must come out exactly as without constrained neighbours (their mask rows are all
ones, and rows a constrained request left are reset)."""

import json
import re
import types

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from seeds import seeded_rng
from zipage_jax import LLM, SamplingParams, StructuredOutputsParams
from zipage_jax.layers.sampler import SamplingRow, SamplingTensors, apply_token_bitmask, sample
from zipage_jax.structured_output.manager import StructuredOutputManager, ll_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "kind": {"enum": ["sum", "product"]},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False},
    },
    "required": ["name", "kind", "inner"],
    "additionalProperties": False,
}
GBNF = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
PROMPTS = ["12+7=", "3+45=", "99+1=", "8+8=", "40+2=", "17+26="]


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=16, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, compilation_cache_dir=None)


def constrained(seed: int, max_tokens: int = 96, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def test_constraints_hold_in_a_batch_and_leave_free_neighbours_unchanged(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS[:3], free, use_tqdm=False)]
    params = ([constrained(s, json=SCHEMA) for s in range(8)] + [constrained(s, regex=r"[a-c]{3}-\d{2}") for s in
              range(2)] + [constrained(s, choice=["yes", "no", "maybe"]) for s in range(2)]
              + [constrained(0, grammar=GBNF, max_tokens=40)] + [free] * 3)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params) - 3)] + PROMPTS[:3]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for out in outs[:8]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all(re.fullmatch(r"[a-c]{3}-\d{2}", o.text) and o.finish_reason == "stop" for o in outs[8:10])
    assert all(o.text in ("yes", "no", "maybe") for o in outs[10:12])
    assert re.fullmatch(r"\(\d+(\+\d+)*\)", outs[12].text) or outs[12].finish_reason == "length", outs[12].text
    assert [o.text for o in outs[13:]] == alone
    # the rows the constrained requests used are all ones again: free requests that land on them are unchanged
    again = [o.outputs[0].text for o in llm.generate(PROMPTS[:3] * 5, free, use_tqdm=False)]
    assert again == alone * 5


def test_a_constraint_cut_by_max_tokens_ends_with_length_and_a_valid_prefix(llm):
    out = llm.generate(PROMPTS[0], constrained(1, max_tokens=4, json=SCHEMA), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.text == '{"na'[:len(out.text)] and len(out.token_ids) == 4


def test_the_constraint_starts_after_the_reasoning_end(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    marker = next(c for c in free.text[1:] if c not in PROMPTS[1])  # first seen in the output, after its start
    head = free.text[:free.text.index(marker) + 1]  # the free text up to the marker's first appearance
    out = llm.generate(PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
            regex="[xyz]{4}", reasoning_end=marker)), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(head) and re.fullmatch("[xyz]{4}", out.text[len(head):]), (head, out.text)
    # a marker already in the prompt: constrained from the first token
    out = llm.generate(PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
            regex="[xyz]{4}", reasoning_end="+")), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[xyz]{4}", out.text)


def test_logit_bias_moves_the_greedy_token_to_the_next_best(llm):
    first = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3),
                         use_tqdm=False)[0].outputs[0]
    ranked = sorted(first.logprobs[0].items(), key=lambda kv: kv[1].rank)
    best, second = ranked[0][0], next(t for t, lp in ranked if lp.rank == 2)
    banned = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={best: -100}),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids == [second]
    forced = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={40: 100}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [40] * 5


def test_bad_constraints_are_value_errors_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid JSON schema"):
        StructuredOutputsParams(json={"type": "bogus"})
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regular expression"):
        StructuredOutputsParams(regex="((")
    with pytest.raises(ValueError, match=r"^structured_outputs: exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"^logit_bias: token id 500 is out of vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={500: 1.0}), use_tqdm=False)
    assert SamplingParams(logit_bias={7: 500, 3: -1}).logit_bias == ((3, -1.0), (7, 100.0))  # clamped, sorted
    with pytest.raises(ValueError, match="^logit_bias must be an int"):
        SamplingParams(logit_bias={"7": 1.0})


def test_constraints_survive_compression_and_preemption():
    """Evicting tokens changes nothing for the grammar (its state lives on the host), nor does a preemption (a
    recompute keeps the output tokens; a swap keeps everything) that moves a request to another token row."""
    llm = LLM(page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, compression=True,
              kv_budget_pages=4, num_gpu_pages_override=20, admission="hybrid", compilation_cache_dir=None)
    pattern = r"(\d\d,){70}"
    outs = llm.generate(PROMPTS[:6], [constrained(s, max_tokens=240, regex=pattern) for s in range(6)],
                        use_tqdm=False)
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outs)
    stats = llm.engine.stats()
    assert stats.totals["compressions"] > 0 and stats.scheduler.num_preemptions + stats.scheduler.num_swaps > 0


def test_the_bitmask_masks_exactly_the_disallowed_tokens():
    rng = seeded_rng()
    vocab = 70  # not a multiple of 32: the last word's high bits are padding
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    allowed = rng.random((5, vocab)) < 0.3
    allowed[:, 0] = True
    words = np.zeros((5, 3), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words.view(np.int32))))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))
    assert np.array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.full((5, 3), -1, jnp.int32))),
                          logits)


def test_logit_bias_tensors_match_adding_the_bias():
    rng = seeded_rng()
    vocab = 50
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bias = [{int(t): float(b) for t, b in zip(rng.choice(vocab, 9, replace=False), rng.normal(size=9) * 3)}, {}, None]
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias=b), [1], [], 0, 0) for b in bias]
    tensors = SamplingTensors.from_rows(rows, vocab, eos_token_ids=[0])
    assert tensors.biased and tensors.bias_token_ids.shape == (3, 16)
    tokens, _ = sample(jnp.asarray(logits), tensors)
    expected = logits.copy()
    for t, b in bias[0].items():
        expected[0, t] += b
    np.testing.assert_array_equal(np.asarray(tokens), expected.argmax(-1))


def _byte_level_tokenizer():
    """A small byte-level BPE (the layout of GPT-2 / Qwen / Llama 3 vocabularies), trained here."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "abc", "sizes": [1, 2]}', "12+7=19", "the answer is 42"] * 20, trainer)
    return types.SimpleNamespace(_tokenizer=tok, encode=lambda s, add_special_tokens=False: tok.encode(s).ids)


def test_a_byte_level_vocabulary_is_read_from_its_pipeline_and_masks_by_bytes():
    tokenizer = _byte_level_tokenizer()
    vocab = tokenizer._tokenizer.get_vocab_size()
    assert ll_tokenizer(tokenizer, vocab, (0,)).vocab_size == vocab
    manager = StructuredOutputManager(tokenizer, vocab, (0,))
    request = types.SimpleNamespace(request_id="r", token_row=3, prompt_token_ids=[5], output_token_ids=[],
                                    output_logprobs=[], num_pending=0, sampling_params=SamplingParams(
                                        structured_outputs=StructuredOutputsParams(regex="[0-9]{2}")))
    manager.add(request)
    bits = manager.bitmask([request])
    assert bits.rows.tolist() == [3]
    allowed = np.flatnonzero(np.unpackbits(bits.masks[0].view(np.uint8), bitorder="little")[:vocab])
    texts = [tokenizer._tokenizer.decode([t]) for t in allowed]
    assert texts and all(re.fullmatch("[0-9]{1,2}", t) for t in texts)
    assert len(allowed) == sum(re.fullmatch("[0-9]{1,2}", tokenizer._tokenizer.decode([t])) is not None
                               for t in range(1, vocab))
    manager.remove(request)
    reset = manager.bitmask([])  # its row goes back to all ones
    assert reset.rows.tolist() == [3] and (reset.masks == -1).all() and manager.bitmask([]) is None
