"""The shipped tiny model loads through the HF path and solves test problems under greedy decoding.

Greedy decoding reproduces the reference solution exactly iff, fed that solution, the model's argmax at
every assistant position is the next reference token (induction over positions). One forward pass per
problem therefore checks a full greedy generation of ~600 tokens cheaply on CPU.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.models import ModelConfig, forward_dense
from zipage_jax.tasks import sample_problems
from zipage_jax.tasks.tokenizer import IM_END_ID, encode_chat
from zipage_jax.models.weights import load_hf_weights
from seeds import fresh_seed

MODEL = Path(__file__).resolve().parents[1] / "zipage_jax" / "assets" / "tiny-reasoner"


def test_shipped_checkpoint_is_small_and_qwen3():
    cfg = ModelConfig.from_pretrained(MODEL)
    assert cfg.model_type == "qwen3" and cfg.eos_token_ids == (IM_END_ID,)
    assert sum(f.stat().st_size for f in MODEL.iterdir()) <= 25 * 2**20


def test_shipped_model_reasons_correctly_under_greedy_decoding():
    cfg = ModelConfig.from_pretrained(MODEL)
    params = load_hf_weights(MODEL, cfg, jnp.float32)
    problems = sample_problems(6, seed=fresh_seed(), split="test")
    seqs = [encode_chat(p.question, p.solution()) for p in problems]
    width = max(map(len, seqs))
    tokens = np.array([s + [IM_END_ID] * (width - len(s)) for s in seqs], np.int32)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(jax.jit(forward_dense, static_argnums=1)(params, cfg, jnp.asarray(tokens)))
    predicted = logits.argmax(-1)
    for row, (p, seq) in enumerate(zip(problems, seqs)):
        start = len(encode_chat(p.question))
        # the whole assistant turn: scratchpad, \boxed{answer} and <|im_end|>
        assert predicted[row, start - 1 : len(seq) - 1].tolist() == seq[start:], f"{p.question} not solved"
