"""Training rows of the shipped tiny model: token ids, per-token loss weights and per-row visibility masks.

Why visibility masks: under compression the engine evicts KV entries while the model generates, so it meets
contexts with holes that full-sequence training never shows it, and loses its way. Part of every batch is
therefore trained on the whole sequence under a mask of what an eviction may leave: each query sees the
digits of the prompt (the operands) and the scratchpad lines the task reads again after a gap
(`recalled_lines`), the rest of the prompt with probability `q`, a recent window of `r` tokens, and every
older token with probability `p` (one draw per token and row, so a token out of the window stays hidden, as an
evicted entry does). The other rows are
plain causal (full KV). The conclusion's tokens (`problem.conclusion`: what is computed once from the finished
scratchpad) carry extra loss weight: they are ~10 to ~30 of ~600 targets, yet they alone need the reversal of the
last LSD-first sum into the MSD-first product, and for interleaved sums the recall of a line from far back and
the addition of two lines. (At weight 1 the sum stayed at chance while the batch loss looked converged: its 7
digits at ln 10 each are ~0.015 of a batch mean, the plateau of the first interleaved-sums run.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from zipage_jax.tasks.tokenizer import PAD_ID, encode_chars, encode_chat

SEQ_LEN = 832  # longest prompt + solution + <|im_end|> is 822 tokens
# Recent tokens an eviction row keeps (inclusive bounds): the last boxed digit copies a digit 20 tokens back, so
# with fewer an answer target would be unreachable; the engine's protected window plus its open page hold 16..31.
WINDOW_RANGE = (24, 160)
OLD_KEEP_PROBS = (0.0, 0.1, 0.3)  # p: chance that a solution token older than the window stays visible
PROMPT_KEEP_PROBS = (0.0, 0.5, 1.0)  # q: the same for the prompt tokens other than the digits
DIGIT_IDS = encode_chars("0123456789")


def conclusion_start(problem) -> int:
    """Index in `encode_chat(question, solution)` of the first token of `problem.conclusion`."""
    return len(encode_chat(problem.question, problem.solution())) - len(problem.conclusion) - 1


def encode_batch(problems: list, answer_weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, SEQ_LEN] (PAD after the end) and loss weights [B, SEQ_LEN-1] (weight of target t+1).

    Weight 1 on every assistant token, `answer_weight` on the conclusion and <|im_end|>, 0 on prompt and padding.
    """
    if answer_weight <= 0:
        raise ValueError(f"answer_weight must be > 0, got {answer_weight}")
    tokens = np.full((len(problems), SEQ_LEN), PAD_ID, np.int32)
    weights = np.zeros((len(problems), SEQ_LEN - 1), np.float32)
    for i, problem in enumerate(problems):
        ids = encode_chat(problem.question, problem.solution())
        tokens[i, : len(ids)] = ids
        weights[i, len(encode_chat(problem.question)) - 1 : len(ids) - 1] = 1.0
        weights[i, conclusion_start(problem) - 1 : len(ids) - 1] = answer_weight
    return tokens, weights


def conclusion_targets(problems: list) -> np.ndarray:
    """[B, SEQ_LEN-1] bool, aligned with `encode_batch`'s weights: the targets of each problem's conclusion
    (<|im_end|> excluded), whose loss the trainer logs per task."""
    mask = np.zeros((len(problems), SEQ_LEN - 1), bool)
    for i, problem in enumerate(problems):
        start = conclusion_start(problem) - 1
        mask[i, start : start + len(problem.conclusion)] = True
    return mask


def sample_visibility(problems: list, rng: np.random.Generator,
                      evict_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row: window [B] int32 and keep [B, SEQ_LEN] bool (see `visibility_mask`).

    A row is an eviction row with probability `evict_fraction`; the others get window SEQ_LEN and keep
    everything (plain causal attention).
    """
    if not 0.0 <= evict_fraction <= 1.0:
        raise ValueError(f"evict_fraction must be in [0, 1], got {evict_fraction}")
    window = np.full(len(problems), SEQ_LEN, np.int32)
    keep = np.ones((len(problems), SEQ_LEN), bool)
    for i, problem in enumerate(problems):
        if rng.random() >= evict_fraction:
            continue
        prompt = encode_chat(problem.question)
        window[i] = rng.integers(WINDOW_RANGE[0], WINDOW_RANGE[1] + 1)
        keep[i] = rng.random(SEQ_LEN) < rng.choice(OLD_KEEP_PROBS)
        keep[i, : len(prompt)] = rng.random(len(prompt)) < rng.choice(PROMPT_KEEP_PROBS)
        keep[i, : len(prompt)] |= np.isin(prompt, DIGIT_IDS)
        keep[i] |= recalled_mask(problem)
    return window, keep


def recalled_mask(problem) -> np.ndarray:
    """[SEQ_LEN] bool: the tokens of the scratchpad lines the task reads again after a gap (none for tasks
    whose problems have no ``recalled_lines``), at their positions in ``encode_chat(question, solution)``."""
    mask = np.zeros(SEQ_LEN, bool)
    start = len(encode_chat(problem.question))
    lines = problem.solution().split("\n")
    offsets = np.cumsum([0] + [len(line) + 1 for line in lines])
    for index in getattr(problem, "recalled_lines", lambda: [])():
        mask[start + offsets[index]: start + offsets[index + 1]] = True
    return mask


def visibility_mask(window, keep):
    """[B, T, T] bool (query, key): causal, and key s visible to query t iff t - s < window or keep[s].

    Built on device inside the jitted step, so only [B] + [B, T] travel per batch.
    """
    t = keep.shape[1]
    q = jnp.arange(t)[:, None]
    k = jnp.arange(t)[None, :]
    recent = (q - k)[None] < window[:, None, None]
    return (k <= q)[None] & (recent | keep[:, None, :])
