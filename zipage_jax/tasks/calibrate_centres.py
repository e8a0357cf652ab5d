"""Calibrate a model's pre-RoPE query centres for the "triattention" eviction policy and write them beside its
weights (``query_centres.npz``, what the engine loads at start-up; ``zipage_jax.compression.query_centres``).

The calibration text is what the model is served on: the chat prompt and reference solution of --problems train
problems of each task (``zipage_jax.tasks.TASKS``), teacher-forced, every non-padding token counted. CPU is
enough for the shipped models (a few seconds):

    python -m zipage_jax.tasks.calibrate_centres --model zipage_jax/assets/tiny-reasoner
    python -m zipage_jax.tasks.calibrate_centres --model zipage_jax/assets/tiny-reasoner-two-tasks \\
        --tasks repeated_addition,interleaved_sums
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from zipage_jax.compression import query_centres
from zipage_jax.models import ModelConfig
from zipage_jax.models.weights import load_hf_weights
from zipage_jax.tasks import TASKS
from zipage_jax.tasks.tokenizer import PAD_ID
from zipage_jax.tasks.training_data import encode_batch


def token_batches(tasks: list[str], problems: int, seed: int, batch: int = 16):
    """(tokens, valid) batches of each task's train problems, teacher-forced (prompt, solution, <|im_end|>)."""
    for i, task in enumerate(tasks):
        items = TASKS[task](problems, seed=seed + i, split="train")
        for start in range(0, len(items), batch):
            tokens, _ = encode_batch(items[start : start + batch])
            yield tokens, tokens != PAD_ID


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory (the centres are written there)")
    p.add_argument("--tasks", default="repeated_addition", help=f"comma-separated, of {sorted(TASKS)}")
    p.add_argument("--problems", type=int, default=64, help="train problems per task")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tasks = args.tasks.split(",")
    if not tasks or set(tasks) - set(TASKS):
        p.error(f"--tasks: unknown {sorted(set(tasks) - set(TASKS))}; known: {sorted(TASKS)}")
    cfg = ModelConfig.from_pretrained(args.model)
    params = load_hf_weights(args.model, cfg, jnp.float32)
    centres = query_centres.calibrate(params, cfg, token_batches(tasks, args.problems, args.seed))
    path = query_centres.save(args.model, centres)
    spread = np.asarray(centres.norm) - np.asarray(query_centres.band_norms(centres.mean))
    concentration = float(np.mean(np.asarray(query_centres.band_norms(centres.mean)) / np.asarray(centres.norm)))
    print(f"wrote {path}: mean {centres.mean.shape}, mean |centre| / mean |q| per band {concentration:.3f}, "
          f"spread term {float(spread.mean()):.3f}")


if __name__ == "__main__":
    main()
