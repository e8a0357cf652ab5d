"""Tensor parallelism over two simulated CPU devices gives the same tokens as one device."""

import jax
import pytest

from zipage_jax import LLM, SamplingParams
from seeds import seeded_rng

MODEL = "tests/fixtures/hf/qwen3_untied"  # 8 q / 2 kv heads: one kv head per shard


@pytest.mark.parametrize("compression", [False, True])
def test_two_way_tensor_parallel_matches_single_device(compression):
    assert len(jax.devices()) >= 2
    rng = seeded_rng()
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(5, 30, size=3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    opts = dict(page_size=16, max_num_seqs=4, max_model_len=128, compilation_cache_dir=None,
                compression=compression, kv_budget_pages=2)
    single = LLM(MODEL, **opts).generate(prompts, params, use_tqdm=False)
    sharded_llm = LLM(MODEL, tensor_parallel_size=2, **opts)
    assert len(sharded_llm.engine.runner.state.k_pool.sharding.device_set) == 2
    sharded = sharded_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]


def test_tensor_parallel_size_must_divide_kv_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(MODEL, tensor_parallel_size=3, compilation_cache_dir=None)
