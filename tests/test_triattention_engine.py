"""The query-free "triattention" eviction policy through the whole engine on the shipped model (CPU, reference
attention): generation under compression keeps the invariants the other policies' engine tests check (pages per
request bounded by M+1, exact page accounting, shared prefix pages untouched, nothing leaked), and a model without
query centres is refused at start-up."""

import dataclasses

import numpy as np
import pytest

from zipage_jax import LLM, SamplingParams
from zipage_jax.config import DEFAULT_MODEL
from zipage_jax.tasks import sample_problems
from zipage_jax.tasks.tokenizer import chat_prompt
from seeds import fresh_seed

PAGE, BUDGET = 16, 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, page_size=PAGE, max_num_seqs=5, max_num_batched_tokens=128, max_model_len=128,
               compilation_cache_dir=None, attention_backend="reference", compression=True,
               kv_budget_pages=BUDGET, eviction_policy="triattention")


def test_generates_with_bounded_pages_shared_prefix_intact_and_no_leaks(llm):
    engine = llm.engine
    assert engine.worker.state.query_centres.mean.shape == (6, 8, 32)
    # scored from the keys alone: no window queries recorded, no bytes for them in the plan
    assert engine.worker.state.query_cache.size == 1 and engine.memory_plan.query_cache_bytes == 0
    questions = [p.question for p in sample_problems(5, seed=fresh_seed(), split="test")]
    prefix = engine.tokenizer.encode(chat_prompt(questions[0]), add_special_tokens=False)
    llm.generate([prefix], dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)  # fills the prefix cache
    shared = [engine.page_manager.hash_to_page[h] for h in list(engine.page_manager.hash_to_page)[:2]]
    before = np.asarray(engine.worker.state.k_pool[:, shared])
    engine.add_request("holder", prefix + [7], dataclasses.replace(GREEDY, kv_budget_pages=8))
    for i, q in enumerate(questions[1:]):
        engine.add_request(f"r{i}", prefix + engine.tokenizer.encode(q, add_special_tokens=False), GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.page_manager.check_invariants(engine.scheduler.running + list(engine.scheduler.waiting))
        assert all(len(r.page_ids) <= BUDGET + 1 for r in engine.scheduler.running if r.compressed)
    compressed = [finished[f"r{i}"].metrics for i in range(4)]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in finished.values())
    assert all(m["num_compressions"] >= 3 and m["peak_kv_pages_after_compression"] <= BUDGET + 1
               for m in compressed)
    np.testing.assert_array_equal(np.asarray(engine.worker.state.k_pool[:, shared]), before)
    assert engine.metrics()["kv_pages_used"] == 0


def test_a_model_without_query_centres_is_refused():
    with pytest.raises(ValueError, match="eviction_policy"):
        LLM("tests/fixtures/hf/qwen3_untied", page_size=PAGE, compilation_cache_dir=None, compression=True,
            kv_budget_pages=BUDGET, eviction_policy="triattention")
