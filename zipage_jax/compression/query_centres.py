"""Per-(layer, query head) statistics of the pre-RoPE queries: what the query-free "triattention" policy scores
keys with (``compression.trig_scores``; TriAttention, arXiv 2604.04921).

Why pre-RoPE: before the rotation a head's queries sit near a fixed centre whatever their position, so the centre
stands in for every future query, where post-RoPE queries from a recent window only stand in for themselves.
Calibrated once from a set of prompts (``centres_from_queries``) and shipped beside the weights
(``CENTRES_FILE`` in the model directory, ``save`` / ``load``); the engine keeps them in its device state.
"""

from __future__ import annotations

from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.models import forward_dense
from zipage_jax.models.rope import inverse_frequencies

CENTRES_FILE = "query_centres.npz"


@flax.struct.dataclass
class QueryCentres:
    """``mean [L, Hq, D]``: the mean pre-RoPE query (the complex centre of band f is ``mean[f] + i mean[f + D/2]``,
    RoPE's rotate-half pairing); ``norm [L, Hq, D/2]``: the mean modulus of each band; ``inv_freq [D/2]``: the
    RoPE frequencies they were calibrated under."""

    mean: jax.Array
    norm: jax.Array
    inv_freq: jax.Array

    @classmethod
    def placeholder(cls) -> "QueryCentres":
        """A tiny stand-in for engines whose policy does not read centres."""
        return cls(jnp.zeros((1, 1, 2), jnp.float32), jnp.zeros((1, 1, 1), jnp.float32), jnp.zeros((1,), jnp.float32))


def band_norms(x):
    """``|x_f|`` ``[..., D/2]`` of vectors ``[..., D]`` in RoPE's rotate-half pairing (f32)."""
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    return jnp.sqrt(jnp.square(x[..., :half]) + jnp.square(x[..., half:]))


def centres_from_queries(queries, valid, inv_freq) -> QueryCentres:
    """The centres of pre-RoPE ``queries [L, B, T, Hq, D]`` over the tokens where ``valid [B, T]`` is true."""
    weight = jnp.asarray(valid, jnp.float32)[None, :, :, None, None]
    count = jnp.maximum(jnp.sum(weight), 1.0)
    mean = jnp.sum(queries.astype(jnp.float32) * weight, axis=(1, 2)) / count
    norm = jnp.sum(band_norms(queries) * weight, axis=(1, 2)) / count
    return QueryCentres(mean, norm, jnp.asarray(inv_freq, jnp.float32))


def calibrate(params, model_cfg, token_batches) -> QueryCentres:
    """Centres of a model's pre-RoPE queries over the non-padding tokens of ``token_batches`` (an iterable of
    ``(tokens [B, T] int32, valid [B, T] bool)``), by dense forwards (``models.forward_dense``)."""
    run = jax.jit(lambda p, t: forward_dense(p, model_cfg, t, return_queries=True)[1])
    total_mean = total_norm = count = 0.0
    for tokens, valid in token_batches:
        part = centres_from_queries(run(params, jnp.asarray(tokens)), valid, np.zeros(1))
        n = float(np.sum(valid))
        total_mean, total_norm, count = total_mean + part.mean * n, total_norm + part.norm * n, count + n
    if not count:
        raise ValueError("token_batches: no valid calibration token")
    inv_freq = inverse_frequencies(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_scaling)
    return QueryCentres(total_mean / count, total_norm / count, jnp.asarray(inv_freq))


def save(directory, centres: QueryCentres) -> Path:
    path = Path(directory) / CENTRES_FILE
    np.savez(path, mean=np.asarray(centres.mean, np.float32), norm=np.asarray(centres.norm, np.float32),
             inv_freq=np.asarray(centres.inv_freq, np.float32))
    return path


def load(directory, model_cfg) -> QueryCentres:
    """The centres shipped in ``directory``, checked against the model's shapes; a ValueError naming
    ``eviction_policy`` when there are none (the policy that needs them)."""
    path = Path(directory) / CENTRES_FILE
    if not path.is_file():
        raise ValueError(f"eviction_policy: 'triattention' needs the model's query centres at {path} "
                         "(python -m zipage_jax.tasks.calibrate_centres writes them)")
    with np.load(path) as data:
        centres = QueryCentres(*(np.asarray(data[k], np.float32) for k in ("mean", "norm", "inv_freq")))
    shape = (model_cfg.num_layers, model_cfg.num_heads, model_cfg.head_dim)
    if centres.mean.shape != shape or centres.norm.shape != shape[:2] + (shape[2] // 2,) \
            or centres.inv_freq.shape != (shape[2] // 2,):
        raise ValueError(f"eviction_policy: {path} holds centres of another model (mean {centres.mean.shape}, "
                         f"expected {shape})")
    return centres
