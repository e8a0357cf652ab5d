"""Tensor parallelism over simulated CPU devices gives the same tokens as one device, and its compiled steps hold
only the collectives the sharding calls for."""

import jax
import jax.numpy as jnp
import pytest

from zipage_jax import LLM, SamplingParams
from zipage_jax.benchmarks.hlo import collectives
from zipage_jax.models.config import ModelConfig
from zipage_jax.tasks.export import save_hf_checkpoint
from zipage_jax.models.weights import init_random_params
from seeds import fresh_seed, seeded_rng

MODEL = "tests/fixtures/hf/qwen3_untied"  # 8 q / 2 kv heads: 3 shards do not divide them
FOUR_KV = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      qk_norm=True, max_position_embeddings=512)
OPTIONS = dict(page_size=16, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64,
               compilation_cache_dir=None, kv_budget_pages=2)


def greedy_run(model, prompts, tensor_parallel_size, compression, **options):
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, compression=compression, **OPTIONS, **options)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    return llm.engine, [o.outputs[0].token_ids for o in outputs]


def random_prompts(vocab):
    rng = seeded_rng()
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(5, 30, size=3)]


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory):
    """A random float32 checkpoint with four KV heads: two per shard of a two-way mesh, one of a four-way mesh."""
    path = tmp_path_factory.mktemp("four_kv_heads")
    c = FOUR_KV
    arch = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    params = init_random_params(c, jax.random.key(fresh_seed()), jnp.float32, std=0.1)
    save_hf_checkpoint(params, arch, path, dtype="float32")
    return str(path)


def test_a_policy_without_window_queries_compresses_per_shard(four_kv_heads):
    """Recent-window eviction keeps no query cache (a replicated stand-in): two shards still compress their own
    heads and give one device's greedy tokens."""
    prompts, runs = random_prompts(FOUR_KV.vocab_size), {}
    for shards in (1, 2):
        engine, runs[shards] = greedy_run(four_kv_heads, prompts, shards, True, eviction_policy="window")
        assert engine.worker.state.query_cache.size == 1 and engine.meter.totals["compressions"] > 0
    assert runs[2] == runs[1]


@pytest.mark.parametrize("compression", [False, True])
def test_two_and_four_way_tensor_parallel_match_single_device_with_only_the_expected_collectives(four_kv_heads,
                                                                                              compression):
    """Two shards (two KV heads each) and four (one each) give one device's greedy tokens. The four-way programs
    hold one all-reduce after attention (``o_proj``) and one after the MLP (``down_proj``) per layer, nothing else:
    embedding, LM head and sampling are replicated, attention and the KV pool stay on their heads; a compression
    (per shard) and a swap hold none."""
    assert len(jax.devices()) >= 4
    prompts = random_prompts(FOUR_KV.vocab_size)
    _, single = greedy_run(four_kv_heads, prompts, 1, compression)
    two_way, two_way_tokens = greedy_run(four_kv_heads, prompts, 2, compression)
    assert len(two_way.worker.state.k_pool.sharding.device_set) == 2
    assert two_way_tokens == single
    engine, sharded = greedy_run(four_kv_heads, prompts, 4, compression)
    assert len(engine.worker.state.k_pool.sharding.device_set) == 4
    assert sharded == single
    assert (engine.meter.totals["compressions"] > 0) == compression
    compiled = engine.worker.programs.compiled
    kinds = {key[0] for key in compiled}
    assert kinds == ({"step", "compress"} if compression else {"step"})
    for key, program in compiled.items():
        found = collectives(program.as_text())
        assert found == ({"all-reduce": 2 * FOUR_KV.num_layers} if key[0] == "step" else {}), key


def test_tensor_parallel_size_must_divide_kv_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(MODEL, tensor_parallel_size=3, compilation_cache_dir=None)


@pytest.mark.parametrize("fields, named", [
    (dict(coordinator_address="nohost"), "coordinator_address"),
    (dict(coordinator_address="10.0.0.1:0", num_processes=2, process_id=0), "coordinator_address"),
    (dict(coordinator_address="10.0.0.1:1234", process_id=0), "num_processes"),
    (dict(num_processes=2), "num_processes"),
    (dict(coordinator_address="10.0.0.1:1234", num_processes=0, process_id=0), "num_processes"),
    (dict(coordinator_address="10.0.0.1:1234", num_processes=2), "process_id"),
    (dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=2), "process_id"),
    (dict(process_id=0), "process_id"),
])
def test_multi_host_fields_are_validated(fields, named):
    from zipage_jax.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{named}:"):
        EngineConfig.from_kwargs(MODEL, **fields)


def test_multi_host_engine_joins_through_jax_distributed_once_before_any_device_query(monkeypatch):
    """``jax.distributed.initialize`` (mocked: one real process) gets the config's fields, before the engine
    asks for a device, and once per process however many engines it builds."""
    events, joined = [], []
    devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *args: events.append("devices") or devices(*args))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: events.append(kw) or joined.append(True))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(joined))
    fields = dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    LLM(MODEL, tensor_parallel_size=2, **fields, **OPTIONS)
    LLM(MODEL, **fields, **OPTIONS)
    assert events[0] == fields and "devices" in events
    assert [e for e in events if e != "devices"] == [fields]
