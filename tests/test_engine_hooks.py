"""The engine's public hooks, which the benchmarks drive it through (docs/ARCHITECTURE.md, Engine step): ``drain``,
step observers, and the benchmarks' own probes over them: ``DecodeReplay`` (``HoldingScheduler``:
tests/test_scheduler.py). Oracle: the same greedy requests run straight through ``generate``."""

import numpy as np
import pytest

from seeds import seeded_rng
from zipage_jax import LLM, SamplingParams
from zipage_jax.benchmarks.probes import DecodeReplay

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tests/fixtures/hf/qwen3", page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
               compilation_cache_dir=None)


def prompts_and_oracle(llm, count=3):
    rng = seeded_rng()
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(5, 30, size=count)]
    return prompts, [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_observers_see_every_step_and_drain_dispatches_nothing(llm):
    engine = llm.engine
    prompts, want = prompts_and_oracle(llm)
    records = []
    engine.add_step_observer(records.append)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"obs-{i}", prompt, GREEDY)
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        calls = engine.worker.programs.call_s
        outputs = engine.step()
        steps += 1
        record = records[-1]
        assert len(records) == steps and (engine.worker.programs.call_s > calls) == (not record.scheduled.empty)
        assert 0 <= record.read_back_s <= record.step_s
        assert 0 <= record.schedule_s and 0 <= record.dispatch_s and record.schedule_s + record.dispatch_s <= record.step_s
        if steps == 4:  # mid-decode: everything sampled so far comes back, and nothing is dispatched
            calls = engine.worker.programs.call_s
            drained = {out.request_id: out for out in engine.drain()}
            got.update((i, out.outputs[0].token_ids) for i, out in drained.items() if out.finished)
            assert engine.worker.programs.call_s == calls and len(records) == steps
            sampled = {r.request_id: 0 for r in record.scheduled.decodes}
            for out in drained.values():  # one more token each than the step's own outputs said
                before = next(o for o in outputs if o.request_id == out.request_id)
                assert len(out.outputs[0].token_ids) == len(before.outputs[0].token_ids) + 1
            assert set(drained) == set(sampled) and engine.drain() == []
        got.update((out.request_id, out.outputs[0].token_ids) for out in outputs if out.finished)
    engine.remove_step_observer(records.append)
    engine.add_request("unobserved", prompts[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(records) == steps
    assert [got[f"obs-{i}"] for i in range(len(prompts))] == want  # drained mid-way: nothing lost


def test_replayed_decode_samples_the_same_and_leaves_the_requests_intact(llm):
    """A replay feeds the step's input tokens as the host now knows them: it samples what the step sampled and
    rewrites the same KV, so the requests then decode on exactly as without it."""
    engine = llm.engine
    prompts, want = prompts_and_oracle(llm)
    records, replay = [], DecodeReplay(engine.worker)
    engine.add_step_observer(records.append)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"replay-{i}", prompt, GREEDY)
    got, replays = {}, 0
    while engine.has_unfinished_requests():
        got.update((out.request_id, out.outputs[0].token_ids) for out in engine.step(only_finished=True))
        decodes = records[-1].scheduled.decodes
        if len(decodes) == len(prompts) and replays < 2:
            drained = engine.drain()
            got.update((out.request_id, out.outputs[0].token_ids) for out in drained if out.finished)
            outputs = {out.request_id: out.outputs[0].token_ids for out in drained}
            for _ in range(2):
                tokens = np.asarray(replay())[:len(decodes)]
                assert tokens.tolist() == [outputs[r.request_id][-1] for r in decodes]
            replays += 1
    engine.remove_step_observer(records.append)
    assert replays == 2
    assert [got[f"replay-{i}"] for i in range(len(prompts))] == want
