"""Query-free key scores of the "triattention" policy (TriAttention, arXiv 2604.04921), from calibrated pre-RoPE
query centres (``compression.query_centres``).

A key's expected logit under a future query at distance ``delta`` is, band by band, ``Re(mu_f conj(k_f)
e^{i w_f delta})`` with ``mu_f`` the query centre: a trigonometric series of the distance. Averaged over the
future offsets ``d`` in ``OFFSETS`` (1, 2, 4, ... as the paper), the series folds into one rotated centre per
head, ``c_f = mu_f e^{i w_f p} mean_d e^{i w_f d}`` at the compression's position ``p``; the pool's keys are post-RoPE
(``k_f e^{i w_f n}``), so ``Re(c_f conj(k_rot_f))`` is that average without knowing any key's position (compaction
loses them) and the score is one dot product per key. The paper's second term, ``sum_f (E|q_f| - |mu_f|) |k_f|``,
credits keys by their norms where the queries spread around their centre. A KV head's score is the max over its
query group.
"""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import gather_request_kv
from zipage_jax.compression.query_centres import band_norms

MAX_OFFSET = 65536  # the paper's offset_max_length
OFFSETS = 2.0 ** np.arange(int(np.log2(MAX_OFFSET)) + 1)  # 1, 2, 4, ..., MAX_OFFSET


def rotated_centres(mean, inv_freq, positions):
    """``c [B, Hq, D]`` (rotate-half layout) of centres ``mean [Hq, D]`` (or one per row, ``[B, Hq, D]``) averaged
    over the future queries at ``positions [B] + OFFSETS``."""
    half = mean.shape[-1] // 2
    angles = jnp.asarray(OFFSETS, jnp.float32)[:, None] * inv_freq[None, :]  # [O, F]
    w_re, w_im = jnp.mean(jnp.cos(angles), axis=0), jnp.mean(jnp.sin(angles), axis=0)
    phase = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [B, F]
    r_re, r_im = jnp.cos(phase) * w_re - jnp.sin(phase) * w_im, jnp.sin(phase) * w_re + jnp.cos(phase) * w_im
    mean = mean if mean.ndim == 3 else mean[None]
    m_re, m_im = mean[..., :half], mean[..., half:]  # [1 or B, Hq, F]
    rotated_re = m_re * r_re[:, None, :] - m_im * r_im[:, None, :]
    rotated_im = m_re * r_im[:, None, :] + m_im * r_re[:, None, :]
    return jnp.concatenate([rotated_re, rotated_im], axis=-1)


def trig_scores(keys, mean, norm, inv_freq, positions):
    """Scores ``[B, Hkv, N]`` f32 of post-RoPE ``keys [B, Hkv, N, D]`` for the queries after ``positions [B]``,
    from one layer's centres (``mean [Hq, D]``, ``norm [Hq, D/2]``) or each row's (``[B, Hq, D]``, ``[B, Hq, D/2]``).
    Scratch: ``[B, Hq, N]`` and ``[B, Hkv, N, D/2]`` f32, less than the window-attention path's."""
    batch, num_kv_heads, num_slots, head_dim = keys.shape
    group = mean.shape[-2] // num_kv_heads
    centres = rotated_centres(mean, inv_freq, positions).reshape(batch, num_kv_heads, group, head_dim)
    trig = jnp.einsum("bhgd,bhnd->bhgn", centres, keys.astype(jnp.float32), preferred_element_type=jnp.float32)
    spread = (norm - band_norms(mean)).reshape(-1, num_kv_heads, group, head_dim // 2)  # [1 or B, ...]
    spread = jnp.broadcast_to(spread, (batch,) + spread.shape[1:])
    extra = jnp.einsum("bhgf,bhnf->bhgn", spread, band_norms(keys), preferred_element_type=jnp.float32)
    return jnp.max(trig + extra, axis=2)


def paged_trig_scores(k_pool, layer, page_tables, centres, positions):
    """``trig_scores`` of the requests in ``page_tables [B, P]`` of one pool layer (or one per row ``[B]``) with
    ``centres``' layer."""
    keys = gather_request_kv(k_pool, layer, page_tables)
    return trig_scores(keys, centres.mean[layer], centres.norm[layer], centres.inv_freq, positions)
