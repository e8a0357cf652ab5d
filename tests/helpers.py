"""Helpers shared by several test modules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.sampling_params import SamplingParams
from zipage_jax.models.rope import rope_cos_sin
from zipage_jax.models import forward_dense
from zipage_jax.models.transformer import _qkv, rms_norm
from zipage_jax.models.weights import load_hf_weights


@functools.cache
def _checkpoint_params(path, cfg, dtype):
    return load_hf_weights(path, cfg, dtype)


def checkpoint_params(engine):
    """The layer-stacked weights of the engine's checkpoint, loaded on their own for the dense oracle (the engine
    itself holds the serving layout)."""
    return _checkpoint_params(engine.config.model, engine.model_cfg, engine.memory_plan.dtype)


@functools.partial(jax.jit, static_argnums=1)
def dense_logits(params, cfg, tokens, attention_mask=None):
    """``forward_dense``, compiled once per shape: run op by op, one forward compiles dozens of small programs."""
    return forward_dense(params, cfg, tokens, attention_mask=attention_mask)


def padded_dense_logits(params, cfg, rows):
    """The dense logits of token rows of several lengths in one batch, each padded to the longest (causal: the
    padding after a row never reaches its own positions); row i's logits are ``out[i, :len(rows[i])]``."""
    width = max(map(len, rows))
    return dense_logits(params, cfg, jnp.asarray([list(r) + [0] * (width - len(r)) for r in rows], jnp.int32))


def warmup_programs(worker) -> list:
    """Every program the worker's warm-up compiles, in its order."""
    return [p for bucket in worker.catalog.warmup_buckets(worker.params, worker.state) for p in bucket.programs]


@functools.partial(jax.jit, static_argnums=1)
def _layer0_qk(params, cfg, tokens, positions):
    layer = jax.tree.map(lambda x: x[0], params.layers)
    cos, sin = rope_cos_sin(positions, cfg)
    h = rms_norm(params.embed[tokens], layer.input_norm, cfg.rms_norm_eps)
    q, k, _ = _qkv(layer, cfg, h, cos, sin)
    return q, k


def layer0_qk(engine, tokens, positions):
    """Post-RoPE layer-0 queries [T, Hq, D] and keys [T, Hkv, D]: functions of token and position alone (compiled
    once per length: op by op, each length compiled a dozen small programs)."""
    q, k = _layer0_qk(checkpoint_params(engine), engine.model_cfg, jnp.asarray(tokens, jnp.int32),
                      jnp.asarray(positions, jnp.int32))
    return np.asarray(q, np.float64), np.asarray(k, np.float64)


def mixed_workload(rng, vocab, count, max_len):
    """Prompts of many lengths (two sharing a prefix) and every sampling feature but the penalties, top-N and
    prompt logprobs included."""
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(1, max_len, size=count)]
    prompts[1] = prompts[0] + prompts[1]
    params = []
    for i, max_tokens in enumerate(rng.integers(2, 24, size=count)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True,
                                         prompt_logprobs=[None, 3][i % 2], logprobs=[None, 20][i % 2]))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=[0, 5][i % 2], min_p=[0.0, 0.05][i % 4 == 1],
                                         seed=i, n=1 + i % 2, min_tokens=2, stop_token_ids=[7], logprobs=i % 4,
                                         max_tokens=int(max_tokens)))
    return prompts, params


def assert_close(out, ref, seed):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"seed {seed}: non-finite output (unwritten rows?)"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-6)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


def shuffled_page_tables(rng, needed, pages_per_row, num_pages):
    """``[B, pages_per_row]`` tables giving row b ``needed[b]`` distinct shuffled pages of 1..num_pages-1 (the
    rest: null page 0)."""
    ids = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(needed), pages_per_row), np.int32)
    start = 0
    for row, n in enumerate(needed):
        tables[row, :n] = ids[start:start + n]
        start += n
    return jnp.asarray(tables)


def random_problem(rng, num_live, pages_per_row, group, window, page_size, head_dim, num_kv_heads=2, layers=2):
    """A bf16 pool with the requests' live slots on distinct shuffled pages (unused entries: null page 0)."""
    needed = [-(-n // page_size) for n in num_live]
    num_pages = sum(needed) + 3
    k_pool = jnp.asarray(rng.standard_normal((layers, num_pages, num_kv_heads, page_size, head_dim)), jnp.bfloat16)
    tables = shuffled_page_tables(rng, needed, pages_per_row, num_pages)
    queries = rng.standard_normal((len(num_live), window, num_kv_heads * group, head_dim))
    return k_pool, tables, jnp.asarray(num_live, jnp.int32), jnp.asarray(queries, jnp.bfloat16)
