"""Model math against HF transformers fixtures (tests/fixtures/hf, made by scripts/make_hf_fixtures.py)."""

import functools
import json
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zipage_jax
from zipage_jax.layers.attention import REFERENCE
from zipage_jax.models import ModelConfig, PagedBatch, forward_dense, forward_paged, to_serving
from zipage_jax.models.params import fuse_columns, unfuse_columns
from zipage_jax.models.weights import load_hf_weights
from seeds import fresh_seed, seeded_rng

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CHECKPOINTS = ["llama", "llama3_rope", "qwen2", "qwen3", "qwen3_untied"]
NEAR_TIE = 1e-4  # HF top-2 margins below this may flip under f32 rounding differences

dense = jax.jit(forward_dense, static_argnums=1)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@functools.cache
def load(name):
    path = FIXTURES / name
    cfg = ModelConfig.from_pretrained(path)
    return cfg, load_hf_weights(path, cfg, jnp.float32), dict(np.load(path / "expected.npz"))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_forward_dense_matches_hf_logits(name):
    cfg, params, expected = load(name)
    logits = dense(params, cfg, jnp.asarray(expected["input_ids"]))
    assert logits.dtype == jnp.float32
    assert rel_err(logits, expected["logits"]) <= 1e-4


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_continuation_matches_hf_generate(name):
    cfg, params, expected = load(name)
    prompt_lens, hf_tokens, margins = expected["prompt_lens"], expected["greedy_ids"], expected["greedy_margins"]
    rows, new = hf_tokens.shape
    # Fixed-width buffer: causal attention makes the padding after each row's current length irrelevant.
    buf = np.zeros((rows, prompt_lens.max() + new), np.int32)
    buf[:, : expected["prompt_ids"].shape[1]] = expected["prompt_ids"]
    lens = prompt_lens.copy()
    ours = np.zeros_like(hf_tokens)
    for step in range(new):
        logits = np.asarray(dense(params, cfg, jnp.asarray(buf)))
        ours[:, step] = logits[np.arange(rows), lens - 1].argmax(-1)
        buf[np.arange(rows), lens] = ours[:, step]
        lens += 1
    near_ties = 0
    for r in range(rows):
        ties = np.flatnonzero(margins[r] < NEAR_TIE)
        stop = ties[0] if ties.size else new  # tokens up to and including a tie step stay comparable
        near_ties += bool(ties.size)
        np.testing.assert_array_equal(ours[r, : stop], hf_tokens[r, : stop], err_msg=f"prompt {r}")
    assert near_ties <= 1, f"{near_ties} of {rows} generations hit a near-tie: fixtures too degenerate"


def _pages_for(rng, counts, num_pages):
    """Disjoint random page lists (page 0, the null page, never handed out)."""
    pages = rng.permutation(np.arange(1, num_pages))
    out, start = [], 0
    for c in counts:
        out.append(pages[start : start + c])
        start += c
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3_untied"])
def test_forward_paged_chunked_prefill_then_decode_equals_dense(name):
    cfg, params, expected = load(name)
    rng = seeded_rng()
    page_size, width = 4, 4
    seqs = [expected["input_ids"][0, :16], expected["input_ids"][1, :13]]
    num_pages = 12
    tables = np.zeros((len(seqs), width), np.int32)
    for r, pages in enumerate(_pages_for(rng, [4, 4], num_pages)):
        tables[r] = pages
    ref = np.asarray(dense(params, cfg, jnp.asarray(np.stack([seqs[0], np.pad(seqs[1], (0, 3))]))))
    shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)  # stale garbage must never be read
    v_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    step = jax.jit(forward_paged, static_argnums=(1, 5))
    serving = to_serving(params)
    backend = REFERENCE
    done = [0, 0]

    def run(chunks, pad_tokens, decode):
        """chunks[r] = number of new tokens of request r this step (0 = padding row in a decode step)."""
        nonlocal k_pool, v_pool
        tokens, positions, slots, owners = [], [], [], []
        for r, n in enumerate(chunks):
            for i in range(done[r], done[r] + n):
                tokens.append(seqs[r][i])
                positions.append(i)
                slots.append(tables[r, i // page_size] * page_size + i % page_size)
                owners.append((r, i))
            if decode and n == 0:  # idle row: null page slot, nothing to attend to
                tokens.append(0), positions.append(0), slots.append(0)
        real = len(owners)
        tokens += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [0] * pad_tokens
        kv_lens = np.array([done[r] + n if n else 0 for r, n in enumerate(chunks)], np.int32)
        cu = None if decode else jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
        logits_idx = [r for r, n in enumerate(chunks) if n] if decode else list(range(real))  # decode: token == row
        batch = PagedBatch(
            tokens=jnp.asarray(tokens, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
            slot_mapping=jnp.asarray(slots, jnp.int32), kv_lens=jnp.asarray(kv_lens),
            page_tables=jnp.asarray(tables), logits_indices=jnp.asarray(logits_idx, jnp.int32), cu_q_lens=cu,
        )
        logits, k_pool, v_pool = step(serving, cfg, k_pool, v_pool, batch, backend)
        want = np.stack([ref[r, i] for r, i in owners])
        assert rel_err(logits, want) <= 1e-4, (chunks, decode)
        for r, n in enumerate(chunks):
            done[r] += n

    run([6, 4], pad_tokens=2, decode=False)
    run([5, 5], pad_tokens=0, decode=False)
    while done[0] < len(seqs[0]):
        run([1, int(done[1] < len(seqs[1]))], pad_tokens=0, decode=True)


def test_forward_paged_returns_post_rope_queries_on_request():
    cfg, params, expected = load("qwen3")
    page_size, t = 4, 6
    pool = jnp.zeros((cfg.num_layers, 3, cfg.num_kv_heads, page_size, cfg.head_dim), jnp.float32)

    def batch(positions):
        return PagedBatch(
            tokens=jnp.asarray(expected["input_ids"][0, :t]), positions=jnp.asarray(positions, jnp.int32),
            slot_mapping=jnp.arange(page_size, page_size + t, dtype=jnp.int32), kv_lens=jnp.array([t], jnp.int32),
            page_tables=jnp.array([[1, 2]], jnp.int32), logits_indices=jnp.array([t - 1], jnp.int32),
            cu_q_lens=jnp.array([0, t], jnp.int32),
        )

    backend = REFERENCE
    serving = to_serving(params)
    logits, _, _ = forward_paged(serving, cfg, pool, pool, batch(np.arange(t)), backend)
    logits_q, _, _, queries = forward_paged(serving, cfg, pool, pool, batch(np.arange(t)), backend, return_queries=True)
    assert queries.shape == (cfg.num_layers, t, cfg.num_heads, cfg.head_dim)
    np.testing.assert_allclose(logits, logits_q, rtol=1e-5, atol=1e-5)
    assert rel_err(logits, expected["logits"][0, t - 1 : t]) <= 1e-4
    # Layer-0 queries depend only on the token and its position; RoPE is a rotation: same norms as at
    # position 0, different vectors (except at position 0 itself).
    _, _, _, unrotated = forward_paged(serving, cfg, pool, pool, batch(np.zeros(t)), backend, return_queries=True)
    q, q0 = np.asarray(queries[0]), np.asarray(unrotated[0])
    np.testing.assert_allclose(np.linalg.norm(q, axis=-1), np.linalg.norm(q0, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(q[0], q0[0], rtol=1e-6)
    assert np.abs(q[1:] - q0[1:]).max() > 1e-2


def test_config_reads_architecture_features():
    qwen2 = ModelConfig.from_pretrained(FIXTURES / "qwen2")
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_pretrained(FIXTURES / "qwen3_untied")
    assert qwen3.qk_norm and not qwen3.attention_bias and not qwen3.tie_word_embeddings
    assert (qwen3.num_heads, qwen3.head_dim, qwen3.q_size, qwen3.hidden_size) == (8, 16, 128, 64)
    llama = ModelConfig.from_pretrained(FIXTURES / "llama3_rope")
    assert llama.rope_theta == 500000.0 and llama.rope_scaling.factor == 8.0
    assert llama.rope_scaling.original_max_position_embeddings == 64
    assert llama.eos_token_ids == (2,) and llama.bos_token_id == 1
    hash(llama)  # static jit argument


def _legacy_hf_config(**overrides):
    """A transformers-4.x style config object: rope_theta / rope_scaling keys, no rope_parameters."""
    fields = dict(
        model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling={"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                      "original_max_position_embeddings": 128},
        tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=0, eos_token_id=[1, 2],
        torch_dtype="bfloat16",
    )
    return types.SimpleNamespace(**{**fields, **overrides})


def test_config_reads_legacy_rope_keys():
    cfg = ModelConfig.from_hf_config(_legacy_hf_config())
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.high_freq_factor == 2.0
    assert cfg.head_dim == 8 and cfg.eos_token_ids == (1, 2) and cfg.dtype == "bfloat16"
    plain = ModelConfig.from_hf_config(_legacy_hf_config(rope_scaling=None, rope_theta=1e4))
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_unsupported_model_type_and_rope_type_raise():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config(_legacy_hf_config(model_type="gpt2"))
    cfg = ModelConfig.from_pretrained(FIXTURES / "llama")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(**{**cfg.__dict__, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_config(_legacy_hf_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def _config_reads_as_through_autoconfig(directory, raw):
    from transformers import AutoConfig

    (directory / "config.json").write_text(json.dumps(raw))
    try:
        expected = ModelConfig.from_hf_config(AutoConfig.from_pretrained(directory))
    except Exception as error:  # noqa: BLE001 (whatever AutoConfig raises, the JSON path must raise too)
        with pytest.raises(type(error)):
            ModelConfig.from_pretrained(directory)
        return
    assert ModelConfig.from_pretrained(directory) == expected, sorted(raw)


FIXTURE_NAMES = ["llama", "llama3_rope", "qwen2", "qwen3", "qwen3_untied"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_config_without_any_one_key_reads_as_through_autoconfig(tmp_path, name):
    """A config.json missing any one key reads the same (or fails the same) as through AutoConfig: the plain-JSON
    path is taken only where no class default could differ."""
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    _config_reads_as_through_autoconfig(tmp_path, raw)
    for key in raw:
        _config_reads_as_through_autoconfig(tmp_path, {k: v for k, v in raw.items() if k != key})


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(FIXTURE_NAMES), data=st.data())
def test_config_without_some_keys_reads_as_through_autoconfig(tmp_path_factory, name, data):
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    dropped = data.draw(st.sets(st.sampled_from(sorted(raw)), max_size=3), label="dropped keys")
    _config_reads_as_through_autoconfig(tmp_path_factory.mktemp("config"),
                                        {k: v for k, v in raw.items() if k not in dropped})


def test_complete_configs_are_read_without_transformers():
    """The shipped model's and the fixtures' configs state every field, so reading them imports no transformers
    (which imports torch where installed: seconds of every start)."""
    paths = [str(FIXTURES / name) for name in FIXTURE_NAMES]
    paths.append(str(Path(zipage_jax.__file__).parent / "assets" / "tiny-reasoner"))
    code = ("import sys; from zipage_jax.models.config import ModelConfig\n"
            f"for p in {paths!r}: ModelConfig.from_pretrained(p)\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_fixture_tokenizer_round_trips_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURES / "qwen3")
    ids = tok("hi there")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 9
    assert tok.decode(ids, skip_special_tokens=True) == "hi there"
    assert tok.eos_token_id == 2


def test_forward_dense_is_differentiable():
    cfg, params, expected = load("qwen2")
    tokens = jnp.asarray(expected["input_ids"][:2, :8])

    def loss(p):
        logits = forward_dense(p, cfg, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    # Directional derivatives against central finite differences along unit directions: the gradient's own
    # (where the derivative is its norm) and a random one; errors measured against the gradient norm, since f32
    # finite differences along a near-orthogonal random direction carry an absolute, not relative, error. One
    # compiled program for it all (op by op, each evaluation would compile dozens of small programs).
    @jax.jit
    def derivatives(params, key):
        value, grads = jax.value_and_grad(loss)(params)
        grad_norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
        keys = iter(jax.random.split(key, 64))
        random_dir = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), params)
        pairs = []
        for direction in (grads, random_dir):
            norm = jnp.sqrt(sum(jnp.vdot(d, d) for d in jax.tree.leaves(direction)))
            direction = jax.tree.map(lambda d: d / norm, direction)
            shifted = lambda s: loss(jax.tree.map(lambda x, d: x + s * eps * d, params, direction))  # noqa: E731
            finite_diff = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
            analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
            pairs.append((finite_diff, analytic))
        return value, [jnp.abs(g).max() for g in jax.tree.leaves(grads)], grad_norm, pairs

    eps = 1e-2
    value, grad_max, grad_norm, pairs = derivatives(params, jax.random.key(seeded_rng().integers(1 << 30)))
    assert all(float(m) > 0 for m in grad_max)
    for finite_diff, analytic in pairs:
        assert abs(float(finite_diff - analytic)) <= 2e-2 * float(grad_norm)
    assert np.isfinite(float(value))


def test_forward_dense_bf16_params_stays_close_to_hf():
    cfg, _, expected = load("qwen3")
    params = load_hf_weights(FIXTURES / "qwen3", cfg, jnp.bfloat16)
    logits = dense(params, cfg, jnp.asarray(expected["input_ids"]))
    assert logits.dtype == jnp.float32
    assert rel_err(logits, expected["logits"]) <= 5e-2


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_fused_columns_give_each_shard_its_own_parts(shards):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal((3, shards * w)).astype(np.float32) for w in (4, 2, 2)]
    fused = np.asarray(fuse_columns([jnp.asarray(p) for p in parts], shards))
    per_shard = np.split(fused, shards, axis=-1)  # what an even column sharding hands each device
    for s, block in enumerate(per_shard):
        want = np.concatenate([np.split(p, shards, axis=-1)[s] for p in parts], axis=-1)
        np.testing.assert_array_equal(block, want, err_msg=f"seed {seed}, shard {s}")
    back = unfuse_columns(jnp.asarray(fused), tuple(p.shape[-1] for p in parts), shards)
    for got, want in zip(back, parts):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"seed {seed}")
