"""Weight loading (HF safetensors -> Params), orbax round trip, random init."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from zipage_jax.models import ModelConfig, forward_dense, weights
from zipage_jax.models.params import param_shapes
from zipage_jax.parallel import make_mesh
from zipage_jax.models.weights import shard_params
from zipage_jax.models.weights import init_random_params, load_hf_weights, load_sharded, restore_params, save_params
from zipage_jax.models.weights import init_random_serving_params, init_random_serving_params_stacked, to_serving

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def assert_params_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def copy_config(src: Path, dst: Path):
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_safetensors_maps_hf_names_to_stacked_in_out_layout(name):
    path = FIXTURES / name
    cfg = ModelConfig.from_pretrained(path)
    hf = load_file(path / "model.safetensors")
    params = load_hf_weights(path, cfg, jnp.float32)
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}."
        np.testing.assert_array_equal(params.layers.q_proj[layer], hf[pre + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(params.layers.down_proj[layer], hf[pre + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(params.layers.post_norm[layer], hf[pre + "post_attention_layernorm.weight"])
        if cfg.attention_bias:
            np.testing.assert_array_equal(params.layers.k_bias[layer], hf[pre + "self_attn.k_proj.bias"])
        if cfg.qk_norm:
            np.testing.assert_array_equal(params.layers.q_norm[layer], hf[pre + "self_attn.q_norm.weight"])
    assert (params.layers.q_bias is None) != cfg.attention_bias
    assert (params.layers.k_norm is None) != cfg.qk_norm
    np.testing.assert_array_equal(params.embed, hf["model.embed_tokens.weight"])
    if cfg.tie_word_embeddings:
        assert params.lm_head is None
    else:
        np.testing.assert_array_equal(params.lm_head, hf["lm_head.weight"].T)
    for field, shape in param_shapes(cfg).items():
        obj = params
        for part in field.split("."):
            obj = getattr(obj, part)
        assert (obj is None and shape is None) or obj.shape == shape, field


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_untied"])
def test_load_sharded_equals_sharding_the_loaded_params(name):
    """Straight into the shards of a two-way mesh: the same arrays with the same shardings as loading whole and
    then sharding, and each device holds only its own heads and hidden columns, read from the checkpoint."""
    path = FIXTURES / name
    cfg = ModelConfig.from_pretrained(path)
    mesh = make_mesh(2, cfg)
    got = load_sharded(path, cfg, jnp.bfloat16, mesh)
    want = shard_params(load_hf_weights(path, cfg, jnp.bfloat16), mesh)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert x.dtype == y.dtype and x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    hf = load_file(path / "model.safetensors")
    pre = "model.layers.1."
    for s, shard in enumerate(sorted(got.layers[1].qkv_proj.addressable_shards, key=lambda a: a.device.id)):
        heads = [hf[pre + f"self_attn.{p}_proj.weight"].T for p in "qkv"]
        mine = np.concatenate([np.split(w, 2, axis=1)[s] for w in heads], axis=1)
        np.testing.assert_array_equal(np.asarray(shard.data, np.float32),
                                      mine.astype(ml_dtypes.bfloat16).astype(np.float32))
    for shard in got.layers[0].down_proj.addressable_shards:
        assert shard.data.shape == (cfg.intermediate_size // 2, cfg.hidden_size)
    for device in mesh.devices.flat:  # what the engine plans with before it loads (it allocates the pool first)
        held = sum(s.data.nbytes for x in jax.tree.leaves(got) for s in x.addressable_shards if s.device == device)
        assert weights.device_bytes(cfg, jnp.bfloat16, mesh, device) == held


def test_sharded_checkpoint_loads_identically(tmp_path):
    src = FIXTURES / "llama"
    cfg = ModelConfig.from_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    copy_config(src, tmp_path / "sharded")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / "sharded" / shard)
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_params_equal(load_hf_weights(tmp_path / "sharded", cfg, jnp.float32), load_hf_weights(src, cfg, jnp.float32))


def test_bf16_checkpoint_and_dtype_cast(tmp_path):
    src = FIXTURES / "qwen3"
    cfg = ModelConfig.from_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    copy_config(src, tmp_path / "bf16")
    save_file({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}, tmp_path / "bf16" / "model.safetensors")
    from_bf16 = load_hf_weights(tmp_path / "bf16", cfg, jnp.bfloat16)
    from_f32 = load_hf_weights(src, cfg, jnp.bfloat16)
    assert from_bf16.embed.dtype == jnp.bfloat16
    assert_params_equal(from_bf16, from_f32)


@pytest.mark.parametrize("name", ["qwen2", "qwen3_untied"])
def test_orbax_round_trip_is_bit_exact(tmp_path, name):
    cfg = ModelConfig.from_pretrained(FIXTURES / name)
    params = load_hf_weights(FIXTURES / name, cfg, jnp.bfloat16)
    save_params(params, tmp_path / "ckpt")
    assert_params_equal(restore_params(tmp_path / "ckpt", cfg), params)
    with pytest.raises(ValueError, match="already exists"):
        save_params(params, tmp_path / "ckpt")


def test_restore_with_mismatched_config_raises(tmp_path):
    cfg = ModelConfig.from_pretrained(FIXTURES / "qwen3")
    save_params(load_hf_weights(FIXTURES / "qwen3", cfg, jnp.float32), tmp_path / "ckpt")
    other = ModelConfig.from_pretrained(FIXTURES / "qwen3_untied")
    with pytest.raises(ValueError, match="field"):
        restore_params(tmp_path / "ckpt", other)
    with pytest.raises(ValueError, match="directory"):
        restore_params(tmp_path / "missing", cfg)


def test_random_init_is_deterministic_by_key():
    cfg = ModelConfig.from_pretrained(FIXTURES / "qwen3_untied")
    a = init_random_params(cfg, jax.random.key(3), jnp.float32)
    assert_params_equal(a, init_random_params(cfg, jax.random.key(3), jnp.float32))
    b = init_random_params(cfg, jax.random.key(4), jnp.float32)
    assert not np.array_equal(a.layers.q_proj, b.layers.q_proj)
    assert not np.array_equal(a.layers.gate_proj, a.layers.up_proj)  # each field draws its own numbers
    assert abs(float(jnp.mean(a.layers.input_norm)) - 1.0) < 0.01
    assert a.lm_head.shape == (cfg.hidden_size, cfg.vocab_size) and a.layers.q_norm.shape == (2, 16)
    assert abs(float(jnp.std(a.layers.up_proj)) - 0.02) < 0.002
    logits = forward_dense(a, cfg, jnp.zeros((1, 4), jnp.int32) + 5)
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("shards", [1, 2])
def test_random_serving_weights_have_the_serving_layout_and_draw_per_layer(shards):
    """What an engine makes after placing its pool: the tree, shapes and dtypes of ``to_serving`` of the stacked
    random weights, deterministic by key, with numbers of their own in every layer and field."""
    cfg = ModelConfig.from_pretrained(FIXTURES / "qwen3_untied")
    a = init_random_serving_params(cfg, jax.random.key(3), jnp.float32, shards)
    want = to_serving(init_random_params(cfg, jax.random.key(3), jnp.float32), shards)
    assert jax.tree.structure(a) == jax.tree.structure(want) and a.shards == shards
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(a)] == [(x.shape, x.dtype) for x in jax.tree.leaves(want)]
    again = init_random_serving_params(cfg, jax.random.key(3), jnp.float32, shards)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(again)))
    other = init_random_serving_params(cfg, jax.random.key(4), jnp.float32, shards)
    assert not np.array_equal(a.layers[0].qkv_proj, other.layers[0].qkv_proj)
    assert not np.array_equal(a.layers[0].down_proj, a.layers[1].down_proj)
    assert abs(float(jnp.mean(a.layers[1].post_norm)) - 1.0) < 0.01
    assert abs(float(jnp.std(a.layers[0].gate_up_proj)) - 0.02) < 0.002
    # the stacked twin (a dense oracle's weights) holds the same numbers
    twin = to_serving(init_random_serving_params_stacked(cfg, jax.random.key(3), jnp.float32), shards)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(twin)))


LOADERS = {"whole": load_hf_weights,
           "sharded": lambda path, cfg, dtype: load_sharded(path, cfg, dtype, make_mesh(2, cfg))}


@pytest.mark.parametrize("loader", LOADERS)
def test_missing_tensor_extra_tensor_and_bad_path_raise(tmp_path, loader):
    load = LOADERS[loader]
    src = FIXTURES / "qwen2"
    cfg = ModelConfig.from_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    missing = "model.layers.1.self_attn.v_proj.bias"
    copy_config(src, tmp_path / "missing")
    save_file({n: t for n, t in tensors.items() if n != missing}, tmp_path / "missing" / "model.safetensors")
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load(tmp_path / "missing", cfg, jnp.float32)
    copy_config(src, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.mlp.extra.weight": tensors[missing]}, tmp_path / "extra" / "model.safetensors")
    with pytest.raises(ValueError, match="extra"):
        load(tmp_path / "extra", cfg, jnp.float32)
    with pytest.raises(ValueError, match="path"):
        load(tmp_path / "nowhere", cfg, jnp.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model.safetensors"):
        load(tmp_path / "empty", cfg, jnp.float32)


@pytest.mark.parametrize("loader", LOADERS)
def test_shape_mismatch_names_the_tensor(tmp_path, loader):
    load = LOADERS[loader]
    src = FIXTURES / "llama"
    cfg = ModelConfig.from_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    copy_config(src, tmp_path / "bad")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load(tmp_path / "bad", cfg, jnp.float32)
