"""Real model shapes for benchmarks with random weights, and the bytes a decode step must move (rooflines)."""

import jax

from zipage_jax.models.config import ModelConfig
from zipage_jax.worker import kv_cache

# datasheet HBM bandwidth by device kind (the first name contained in jax's device_kind); an H200's elsewhere
HBM_PEAK_BYTES_PER_S = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12}


def hbm_peak_bytes_per_s(device_kind: str) -> float:
    """The card's peak HBM bandwidth, so that a roofline fraction measured on an H100 is not read against an H200's
    (an H200's figure for other kinds, e.g. a CPU running a benchmark's small case)."""
    return next((peak for name, peak in HBM_PEAK_BYTES_PER_S.items() if name in device_kind),
                HBM_PEAK_BYTES_PER_S["H200"])

MODEL_SHAPES = {
    "qwen3-8b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=False, qk_norm=True,
                            max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-32b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                             num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                             rope_theta=1e6, tie_word_embeddings=False, qk_norm=True,
                             max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-0.6b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1e6, tie_word_embeddings=True, qk_norm=True,
                              max_position_embeddings=40960, dtype="bfloat16"),
    "tiny": ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                        tie_word_embeddings=False, qk_norm=True, max_position_embeddings=4096, dtype="float32"),
}


def weight_bytes_per_step(params, model_cfg: ModelConfig, batch: int) -> int:
    """Parameter bytes a decode step reads: everything but the embedding table, of which it gathers ``batch``
    rows (unless the embedding is tied, then the whole table is the LM head)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if model_cfg.tie_word_embeddings:
        return total
    return total - params.embed.nbytes + batch * params.embed.nbytes // model_cfg.vocab_size


def kv_bytes_per_token(model_cfg: ModelConfig, dtype) -> int:
    return kv_cache.page_bytes(model_cfg, 1, dtype)
