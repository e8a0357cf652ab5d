"""CPU measurement behind docs/lab-notes/fp8-kv.md: which FP8 scale scheme the pool uses.

For the shipped model's real K/V (reasoning traces of both tasks) and for synthetic K/V with outlier channels (the
shape of large models' keys), per FP8 format and scale scheme: the attention output error of the last W queries
against the bf16 pool (f32 math both ways), the kept-token agreement of compression's window scores at a 50 %
budget, and the share of values a static scale clips. Schemes: static per (layer, KV head) calibrated on a random-token
prompt (what the engine does), on a real trace, per-token scales (one per slot and head), and unit scales (vLLM's
default without calibration). Run: python -m zipage_jax.bench fp8-scales
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import SCALE_MARGIN
from zipage_jax.compression.scoring import window_attention
from zipage_jax.config import DEFAULT_MODEL
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.params import to_serving
from zipage_jax.models.rope import rope_cos_sin
from zipage_jax.models.transformer import _dense_causal_attention, _fused_mlp, _fused_qkv, rms_norm
from zipage_jax.models.weights import load_hf_weights
from zipage_jax.tasks import interleaved_sums, repeated_addition
from zipage_jax.tasks.tokenizer import encode_chat
from zipage_jax.worker.kv_scales import calibration_tokens

WINDOW = 16
FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def qkv(params, cfg, tokens):
    """q [L, T, Hq, D], k / v [L, T, Hkv, D] (f32) of one sequence through the model."""
    cos, sin = rope_cos_sin(jnp.arange(len(tokens)), cfg)
    x, out = params.embed[jnp.asarray(tokens)], []
    for layer in params.layers:
        q, k, v = _fused_qkv(layer, cfg, 1, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin)
        x = x + _dense_causal_attention(q[None], k[None], v[None], cfg.head_dim ** -0.5)[0].reshape(
            x.shape[0], cfg.q_size) @ layer.o_proj
        x = x + _fused_mlp(layer, cfg, 1, x)
        out.append((q, k, v))
    return [jnp.stack(t).astype(jnp.float32) for t in zip(*out)]


def fake(x, scale, dtype):
    """x quantized with ``scale`` (broadcastable) and dequantized; and the share of values it clips."""
    top = float(jnp.finfo(dtype).max)
    y = x / scale
    return jnp.clip(y, -top, top).astype(dtype).astype(jnp.float32) * scale, float(jnp.mean(jnp.abs(y) > top))


def static_scale(amax, dtype):  # amax [L, Hkv]
    return (amax * SCALE_MARGIN / float(jnp.finfo(dtype).max))[:, None, :, None]


def per_token_scale(x, dtype):
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def attention_error(q, k, v, k2, v2):
    """Relative L2 error of the last W queries' causal outputs, K/V replaced by k2 / v2; mean over layers."""
    T, group = k.shape[1], q.shape[2] // k.shape[2]
    errs = []
    for layer in range(k.shape[0]):
        qq = q[layer, -WINDOW:].reshape(WINDOW, k.shape[2], group, -1)
        mask = jnp.arange(T)[None, :] <= (T - WINDOW + jnp.arange(WINDOW))[:, None]

        def attend(kk, vv):
            s = jnp.einsum("qhgd,khd->hgqk", qq, kk) * k.shape[-1] ** -0.5
            p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
            return jnp.einsum("hgqk,khd->hgqd", p, vv)

        ref, got = attend(k[layer], v[layer]), attend(k2[layer], v2[layer])
        errs.append(float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
    return float(np.mean(errs))


def kept_agreement(q, k, k2):
    """Share of the top-50 % window-score slots (outside the protected window) kept alike with k and k2."""
    T = k.shape[1]
    live = jnp.array([T])
    agree = []
    for layer in range(k.shape[0]):
        queries = q[layer, -WINDOW:][None]
        a = window_attention(k[layer].transpose(1, 0, 2)[None], queries, live, k.shape[-1] ** -0.5)[0]
        b = window_attention(k2[layer].transpose(1, 0, 2)[None], queries, live, k.shape[-1] ** -0.5)[0]
        n = T - WINDOW
        keep = n // 2
        for h in range(a.shape[0]):
            ka = set(np.argsort(-np.asarray(a[h, :n]), kind="stable")[:keep].tolist())
            kb = set(np.argsort(-np.asarray(b[h, :n]), kind="stable")[:keep].tolist())
            agree.append(len(ka & kb) / keep)
    return float(np.mean(agree)), float(np.min(agree))


def schemes(k, v, calib, dtype):
    """name -> (k2, v2, clipped share) for each scale scheme."""
    out = {}
    for name, (ka, va) in calib.items():
        k2, ck = fake(k, static_scale(ka, dtype), dtype)
        v2, cv = fake(v, static_scale(va, dtype), dtype)
        out[f"static ({name} calibration)"] = (k2, v2, max(ck, cv))
    out["per-token"] = (fake(k, per_token_scale(k, dtype), dtype)[0], fake(v, per_token_scale(v, dtype), dtype)[0], 0.0)
    k2, ck = fake(k, 1.0, dtype)
    v2, cv = fake(v, 1.0, dtype)
    out["unit scale"] = (k2, v2, max(ck, cv))
    return out


def amax(x):
    return jnp.max(jnp.abs(x), axis=(1, 3))  # [L, Hkv]


def measure(name, q, k, v, calib, results):
    kb, vb = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (k, v))
    results.append({"input": name, "format": "bf16", "scheme": "-", "attn_rel_err": attention_error(q, k, v, kb, vb),
                    "kept_agree_mean": kept_agreement(q, k, kb)[0], "kept_agree_min": kept_agreement(q, k, kb)[1],
                    "clipped": 0.0})
    for fmt, dtype in FORMATS.items():
        for scheme, (k2, v2, clipped) in schemes(k, v, calib, dtype).items():
            mean, low = kept_agreement(q, kb, k2)
            results.append({"input": name, "format": fmt, "scheme": scheme, "clipped": clipped,
                            "attn_rel_err": attention_error(q, kb, vb, k2, v2),
                            "kept_agree_mean": mean, "kept_agree_min": low})


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="python -m zipage_jax.bench fp8-scales", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None) -> list[dict]:
    build_parser().parse_args(argv)
    cfg = ModelConfig.from_pretrained(DEFAULT_MODEL)
    params = to_serving(load_hf_weights(DEFAULT_MODEL, cfg, jnp.bfloat16))
    results = []
    _, k_rand, v_rand = qkv(params, cfg, calibration_tokens(cfg.vocab_size))
    train = repeated_addition.sample_problems(1, 1, "train")[0]
    _, k_train, v_train = qkv(params, cfg, encode_chat(train.question, train.solution()))
    calib = {"random-token": (amax(k_rand), amax(v_rand)), "real-trace": (amax(k_train), amax(v_train))}
    for task in (repeated_addition, interleaved_sums):
        for i, p in enumerate(task.sample_problems(2, 7, "test")):
            q, k, v = qkv(params, cfg, encode_chat(p.question, p.solution()))
            measure(f"{task.__name__.split('.')[-1]}[{i}] T={k.shape[1]}", q, k, v, calib, results)
    # synthetic large-model-like keys: N(0, 1) with 4 of 128 channels x20 (RoPE outlier pairs); 4096 slots, 8 heads
    rng = np.random.default_rng(0)
    L, T, H, D = 4, 4096, 8, 128
    scale_ch = np.ones(D, np.float32)
    scale_ch[[3, 67, 20, 84]] = 20.0
    k = jnp.asarray(rng.standard_normal((L, T, H, D)).astype(np.float32) * scale_ch)
    v = jnp.asarray(rng.standard_normal((L, T, H, D)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((L, T, 4 * H, D)).astype(np.float32) * scale_ch * 0.05)
    kc = jnp.asarray(rng.standard_normal((L, 512, H, D)).astype(np.float32) * scale_ch)
    vc = jnp.asarray(rng.standard_normal((L, 512, H, D)).astype(np.float32))
    measure("synthetic outliers T=4096", q, k, v, {"random-token": (amax(kc), amax(vc))}, results)
    for r in results:
        print(json.dumps(r))
    return results
