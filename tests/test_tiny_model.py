"""The shipped tiny models load through the HF path and solve test problems under greedy decoding.

Greedy decoding reproduces the reference solution exactly iff, fed that solution, the model's argmax at
every assistant position is the next reference token (induction over positions). One forward pass per
problem therefore checks a full greedy generation of ~600 tokens cheaply on CPU.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax.models import ModelConfig, forward_dense
from zipage_jax.tasks import TASKS
from zipage_jax.tasks.tokenizer import IM_END_ID, encode_chat
from zipage_jax.models.weights import load_hf_weights
from seeds import fresh_seed

ASSETS = Path(__file__).resolve().parents[1] / "zipage_jax" / "assets"
MODEL = ASSETS / "tiny-reasoner"
TWO_TASKS = ASSETS / "tiny-reasoner-two-tasks"
# (model, task, problems, most allowed wrong): held-out accuracy with full KV is 100 % for the first model and
# 99.75 % / 100 % for the two-task one (README), so one miss in 8 is allowed there, not a systematic failure
CASES = [(MODEL, "repeated_addition", 6, 0), (TWO_TASKS, "repeated_addition", 8, 1),
         (TWO_TASKS, "interleaved_sums", 8, 1)]


@pytest.mark.parametrize("model", [MODEL, TWO_TASKS], ids=lambda m: m.name)
def test_shipped_checkpoint_is_small_and_qwen3(model):
    cfg = ModelConfig.from_pretrained(model)
    assert cfg.model_type == "qwen3" and cfg.eos_token_ids == (IM_END_ID,)
    assert sum(f.stat().st_size for f in model.iterdir()) <= 25 * 2**20


@pytest.mark.parametrize("model,task,n,allowed", CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_shipped_model_reasons_correctly_under_greedy_decoding(model, task, n, allowed):
    cfg = ModelConfig.from_pretrained(model)
    params = load_hf_weights(model, cfg, jnp.float32)
    seed = fresh_seed()
    problems = TASKS[task](n, seed=seed, split="test")
    seqs = [encode_chat(p.question, p.solution()) for p in problems]
    width = max(map(len, seqs))
    tokens = np.array([s + [IM_END_ID] * (width - len(s)) for s in seqs], np.int32)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(jax.jit(forward_dense, static_argnums=1)(params, cfg, jnp.asarray(tokens)))
    predicted = logits.argmax(-1)
    # the whole assistant turn: scratchpad, \boxed{answer} and <|im_end|>
    starts = [len(encode_chat(p.question)) for p in problems]
    wrong = [p.question for row, (p, seq, start) in enumerate(zip(problems, seqs, starts))
             if predicted[row, start - 1 : len(seq) - 1].tolist() != seq[start:]]
    assert len(wrong) <= allowed, f"seed {seed}: not solved: {wrong}"
