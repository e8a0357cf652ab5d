"""Every table derived from the weight declarations (`models.params.WEIGHTS`) against an explicit expectation,
per family: the stacked shapes, the HF tensors read (and written back by the export), which are transposed, the
serving buffers and their fused parts, the tensor-parallel split of each serving buffer and the random init.
A wrong declaration (a shape axis, an HF name, a fusion group or its order, a split, an initializer, when a
weight is present) fails here, whatever the fixtures' real checkpoints happen to exercise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file
from seeds import seeded_rng

from zipage_jax.models.config import ModelConfig
from zipage_jax.models.params import (
    SERVING_LAYER_PARTS,
    LayerParams,
    ServingLayer,
    param_shapes,
    to_serving,
)
from zipage_jax.models.weights import init_random_params, load_hf_weights, load_sharded
from zipage_jax.parallel import make_mesh
from zipage_jax.tasks.export import hf_state_dict

L, V, HD, INTER, HQ, HKV, D = 3, 17, 10, 14, 4, 2, 6  # pairwise distinct sizes, so a wrong axis changes a shape
Q, KV = HQ * D, HKV * D
COLUMN, ROW = P(None, "tp"), P("tp", None)

# field: (Params shape, HF tensor of layer 1 (or the one tensor), HF stores it transposed, random init)
COMMON = {
    "embed": ((V, HD), "model.embed_tokens.weight", False, "normal"),
    "layers.input_norm": ((L, HD), "model.layers.1.input_layernorm.weight", False, "ones"),
    "layers.q_proj": ((L, HD, Q), "model.layers.1.self_attn.q_proj.weight", True, "normal"),
    "layers.k_proj": ((L, HD, KV), "model.layers.1.self_attn.k_proj.weight", True, "normal"),
    "layers.v_proj": ((L, HD, KV), "model.layers.1.self_attn.v_proj.weight", True, "normal"),
    "layers.o_proj": ((L, Q, HD), "model.layers.1.self_attn.o_proj.weight", True, "normal"),
    "layers.post_norm": ((L, HD), "model.layers.1.post_attention_layernorm.weight", False, "ones"),
    "layers.gate_proj": ((L, HD, INTER), "model.layers.1.mlp.gate_proj.weight", True, "normal"),
    "layers.up_proj": ((L, HD, INTER), "model.layers.1.mlp.up_proj.weight", True, "normal"),
    "layers.down_proj": ((L, INTER, HD), "model.layers.1.mlp.down_proj.weight", True, "normal"),
    "final_norm": ((HD,), "model.norm.weight", False, "ones"),
}
BIASES = {
    "layers.q_bias": ((L, Q), "model.layers.1.self_attn.q_proj.bias", False, "normal"),
    "layers.k_bias": ((L, KV), "model.layers.1.self_attn.k_proj.bias", False, "normal"),
    "layers.v_bias": ((L, KV), "model.layers.1.self_attn.v_proj.bias", False, "normal"),
}
QK_NORMS = {
    "layers.q_norm": ((L, D), "model.layers.1.self_attn.q_norm.weight", False, "ones"),
    "layers.k_norm": ((L, D), "model.layers.1.self_attn.k_norm.weight", False, "ones"),
}
LM_HEAD = {"lm_head": ((HD, V), "lm_head.weight", True, "normal")}

# serving field: (its parts, in fused order; its shape; its split over two devices)
SERVING = {
    "input_norm": (("input_norm",), (HD,), P()),
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), (HD, Q + 2 * KV), COLUMN),
    "o_proj": (("o_proj",), (Q, HD), ROW),
    "post_norm": (("post_norm",), (HD,), P()),
    "gate_up_proj": (("gate_proj", "up_proj"), (HD, 2 * INTER), COLUMN),
    "down_proj": (("down_proj",), (INTER, HD), ROW),
    "qkv_bias": (("q_bias", "k_bias", "v_bias"), (Q + 2 * KV,), P("tp")),
    "q_norm": (("q_norm",), (D,), P()),
    "k_norm": (("k_norm",), (D,), P()),
}
SERVING_TOP = {"embed": ((V, HD), P()), "final_norm": ((HD,), P()), "lm_head": ((HD, V), P())}

FAMILIES = {  # (model_type, attention_bias, qk_norm, tied) -> the weights it has
    "llama_untied": (("llama", False, False, False), {**COMMON, **LM_HEAD}),
    "llama_tied": (("llama", False, False, True), COMMON),
    "qwen2_biases_tied": (("qwen2", True, False, True), {**COMMON, **BIASES}),
    "qwen3_qk_norms_untied": (("qwen3", False, True, False), {**COMMON, **QK_NORMS, **LM_HEAD}),
}


def model_config(model_type, attention_bias, qk_norm, tied) -> ModelConfig:
    return ModelConfig(model_type=model_type, vocab_size=V, hidden_size=HD, intermediate_size=INTER, num_layers=L,
                       num_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-6, rope_theta=10_000.0,
                       tie_word_embeddings=tied, attention_bias=attention_bias, qk_norm=qk_norm)


def field(tree, name: str):
    for part in name.split("."):
        tree = getattr(tree, part)
    return tree


def write_checkpoint(path, expected: dict, rng) -> dict[str, np.ndarray]:
    """A safetensors checkpoint holding exactly the expected tensors, under the expected names, random values."""
    tensors = {}
    for shape, hf_name, transposed, _ in expected.values():
        per_tensor = shape[1:] if hf_name.startswith("model.layers.") else shape
        hf_shape = per_tensor[::-1] if transposed else per_tensor
        names = [hf_name.replace(".1.", f".{i}.", 1) for i in range(L)] if shape != per_tensor else [hf_name]
        for name in names:
            tensors[name] = rng.standard_normal(hf_shape).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_the_serving_layout_and_the_pytrees_hold_the_declared_weights():
    assert SERVING_LAYER_PARTS == {name: parts for name, (parts, _, _) in SERVING.items()}
    layer_weights = {n.removeprefix("layers.") for n in {**COMMON, **BIASES, **QK_NORMS} if n.startswith("layers.")}
    assert set(LayerParams.__dataclass_fields__) == layer_weights
    assert set(ServingLayer.__dataclass_fields__) == set(SERVING)


@pytest.mark.parametrize("family", FAMILIES)
def test_derived_tables_match_the_explicit_expectation(tmp_path, family):
    flags, expected = FAMILIES[family]
    cfg = model_config(*flags)
    everything = {**COMMON, **BIASES, **QK_NORMS, **LM_HEAD}
    assert param_shapes(cfg) == {name: expected[name][0] if name in expected else None for name in everything}

    # the HF load path reads exactly these tensors (any other one, or one missing, raises), transposing these
    rng = seeded_rng()
    tensors = write_checkpoint(tmp_path / "ckpt", expected, rng)
    params = load_hf_weights(tmp_path / "ckpt", cfg, jnp.float32)
    for name, (shape, hf_name, transposed, _) in expected.items():
        got = np.asarray(field(params, name))
        layer_one = got[1] if name.startswith("layers.") else got
        np.testing.assert_array_equal(layer_one, tensors[hf_name].T if transposed else tensors[hf_name])
    for name in everything.keys() - expected.keys():
        assert field(params, name) is None, name

    # the export writes them back under the same names (the qwen3 layout has no biases)
    if not cfg.attention_bias:
        exported = hf_state_dict(params, "float32")
        assert exported.keys() == tensors.keys()
        for name, tensor in tensors.items():
            np.testing.assert_array_equal(exported[name], tensor)

    # the serving layout: fused buffers grouped per shard, each buffer split as declared, straight from the file
    mesh = make_mesh(2, cfg)
    sharded = load_sharded(tmp_path / "ckpt", cfg, jnp.float32, mesh)
    assert sharded.shards == 2
    for name, (shape, spec) in SERVING_TOP.items():
        leaf = getattr(sharded, name)
        if name not in expected:
            assert leaf is None, name
            continue
        assert leaf.shape == shape and leaf.sharding.spec == spec, name
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(field(params, name)))
    for i, layer in enumerate(sharded.layers):
        for name, (parts, shape, spec) in SERVING.items():
            leaf = getattr(layer, name)
            if f"layers.{parts[0]}" not in expected:
                assert leaf is None, name
                continue
            assert leaf.shape == shape and leaf.sharding.spec == spec, name
            pieces = [np.asarray(field(params.layers, p)[i]) for p in parts]
            want = np.concatenate([np.split(p, 2, axis=-1)[s] for s in range(2) for p in pieces], axis=-1)
            np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=name)
    single = to_serving(params)  # one shard: the parts side by side
    qkv = [np.asarray(field(params.layers, p)[0]) for p in SERVING["qkv_proj"][0]]
    np.testing.assert_array_equal(np.asarray(single.layers[0].qkv_proj), np.concatenate(qkv, axis=-1))

    # random init: the declared shapes, norm scales near 1, the rest near 0
    random = init_random_params(cfg, jax.random.key(0), jnp.float32, std=0.02)
    for name, (shape, _, _, init) in expected.items():
        value = np.asarray(field(random, name))
        assert value.shape == shape, name
        np.testing.assert_allclose(value, 1.0 if init == "ones" else 0.0, atol=0.2, err_msg=name)
        assert np.std(value) > 0, name
