"""The eviction trace names the positions each (layer, KV head) holds, checked against what must and cannot be;
the diagnosis script built on it names the tokens each scratchpad line reads.

Oracle: at layer 0 a key is a function of its token and its position alone, so the keys the pool holds after a
compression must equal the layer-0 keys recomputed densely at the positions the trace assigns them; and every
snapshot holds exactly the budget, the protected window and the sinks, in increasing order.
"""

import numpy as np

from helpers import layer0_qk
from zipage_jax import LLM, SamplingParams
from zipage_jax.benchmarks.eviction_diagnosis import line_inputs
from zipage_jax.benchmarks.eviction_trace import EvictionTrace
from zipage_jax.tasks import interleaved_sums
from zipage_jax.tasks.tokenizer import VOCAB, encode_chat
from seeds import fresh_seed

MODEL = "tests/fixtures/hf/qwen3_untied"  # 2 layers, GQA 8 q / 2 kv heads, f32
PAGE, BUDGET, WINDOW, SINKS = 16, 2, 8, 2


def test_trace_positions_match_the_pool_keys_and_the_protected_slots():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    llm = LLM(MODEL, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256,
              compilation_cache_dir=None, compression=True, kv_budget_pages=BUDGET, window=WINDOW,
              sink_tokens=SINKS)
    trace, kept_keys = EvictionTrace(llm), {}

    def keys_after(dispatch, run):  # layer-0 keys of each request's destination pages (a second observer)
        run()
        for c in dispatch.compressions:
            pages = np.asarray(dispatch.state().k_pool[0, np.asarray(c.dst_pages)])  # [P, Hkv, S, D]
            kept_keys[(c.request.request_id, c.logical_len)] = pages.transpose(1, 0, 2, 3).reshape(
                pages.shape[1], -1, pages.shape[-1])

    llm.engine.add_compression_observer(keys_after)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (5, 21, 40)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6 * PAGE, ignore_eos=True),
                           use_tqdm=False)
    assert len(trace.snapshots) == len(prompts), seed
    for out in outputs:
        rid = f"{out.request_id}-0"
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        _, k0 = layer0_qk(llm.engine, tokens, np.arange(len(tokens)))
        snapshots = trace.snapshots[rid]
        assert len(snapshots) >= 4, seed
        for snap in snapshots:
            protected = set(range(snap.logical_len - WINDOW, snap.logical_len)) | set(range(SINKS))
            for layer, row in enumerate(snap.positions):
                for head, held in enumerate(row):
                    assert len(held) == BUDGET * PAGE and np.all(np.diff(held) > 0), seed
                    assert held[-1] < snap.logical_len and protected <= set(held.tolist()), seed
                    if layer == 0:
                        np.testing.assert_allclose(kept_keys[(rid, snap.logical_len)][head], k0[held, head],
                                                   rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")
        # held(): all before the first compression, then the snapshot in force at the queried position
        first, last = snapshots[0], snapshots[-1]
        assert trace.held(rid, 3, at=first.logical_len - 1).all(), seed
        evicted = sorted(set(range(last.logical_len)) - set(last.positions[0][0].tolist()))
        assert evicted and not trace.held(rid, evicted[0], at=last.logical_len)[0, 0], seed
        assert trace.held(rid, last.logical_len, at=last.logical_len + 1).all(), seed


def test_diagnosis_names_the_tokens_each_line_reads():
    """`bench eviction-diagnosis`'s inputs of a line, read back as text: the multiplicand's digits in the prompt,
    the line above, and after a block switch the same multiplication's previous line."""
    chars = {i: c for c, i in VOCAB.items()}
    for problem in interleaved_sums.sample_problems(4, seed=fresh_seed(), split="test"):
        ids = encode_chat(problem.question, problem.solution())

        def text(positions):
            return "".join(chars[ids[p]] for p in positions)

        lines = problem.solution().split("\n")
        rows = line_inputs(problem, len(encode_chat(problem.question)))
        assert len(rows) == len(problem.lines())
        for i, row in enumerate(rows):
            name = lines[i][0]
            assert text([row["at"]]) == lines[i][4], problem
            assert text(row["reads"]["multiplicand"]) == str(problem.a if name == "X" else problem.c)
            if i:
                assert text(row["reads"]["line above"]) == lines[i - 1][4:]
            gap = row["reads"].get("same name, after a gap")
            assert (gap is not None) == (row["kind"] == "block start" and f"{name}01" not in lines[i]), problem
            if gap is not None:
                previous = [line for line in lines[:i] if line[0] == name][-1]
                assert text(gap) == previous[4:] and int(previous[1:3]) + 1 == int(lines[i][1:3])
