"""Train the shipped tiny reasoning model (Qwen3 architecture) on the repeated-addition task.

Reproducible by seed: the init key and every batch are functions of --seed and the step index.
Ends with a greedy evaluation on held-out test problems and writes the HF checkpoint to --out.

    PYTHONPATH=. python3 scripts/train_tiny.py --out /tmp/tiny-reasoner --steps 2000
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zipage_jax.models import ModelConfig, Params, forward_dense
from zipage_jax.tasks.export import qwen3_hf_config, save_hf_checkpoint
from zipage_jax.tasks.repeated_addition import SUM_DIGITS, Problem, boxed_answer, sample_problems
from zipage_jax.tasks.tokenizer import IM_END_ID, PAD_ID, encode_chat
from zipage_jax.weights import init_random_params, load_hf_weights

SEQ_LEN = 832  # longest prompt + solution + <|im_end|> is 822 tokens
TIMING_STEPS = 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the HF checkpoint and logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--eval-problems", type=int, default=200)
    p.add_argument("--greedy-samples", type=int, default=200, help="eval problems also decoded greedily")
    p.add_argument("--init", default=None, help="HF checkpoint to continue from instead of a random init")
    p.add_argument("--answer-only", action="store_true", help="loss on the boxed answer tokens only")
    p.add_argument("--window-lines", type=int, default=None,
                   help="train on prompt + N consecutive lines (see encode_window_batch)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--train-seconds", type=float, default=None,
                   help="shrink --steps to what fits in this wall time, measured after %d warm steps; the "
                        "chosen step count is printed, and --steps N with it reproduces the run" % TIMING_STEPS)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.train_seconds is not None and args.warmup <= TIMING_STEPS + 4:
        raise ValueError(f"--warmup must exceed {TIMING_STEPS + 4} with --train-seconds (the sizing happens in warmup)")
    return args


def architecture(args) -> dict:
    """transformers Qwen3Config keyword arguments of the model."""
    return dict(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def encode_batch(problems: list[Problem], answer_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, SEQ_LEN] (PAD after the end) and loss mask [B, SEQ_LEN-1] over the assistant's tokens
    (with `answer_only`, over the final `\\boxed{...}<|im_end|>` only)."""
    tokens = np.full((len(problems), SEQ_LEN), PAD_ID, np.int32)
    mask = np.zeros((len(problems), SEQ_LEN - 1), np.float32)
    for i, problem in enumerate(problems):
        prompt_len = len(encode_chat(problem.question))
        ids = encode_chat(problem.question, problem.solution())
        tokens[i, : len(ids)] = ids
        first = len(ids) - len(f"\\boxed{{{problem.answer}}}") - 1 if answer_only else prompt_len
        mask[i, first - 1 : len(ids) - 1] = 1.0  # targets = ids[first:]
    return tokens, mask


def encode_window_batch(problems: list[Problem], lines: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt + `lines` consecutive solution lines (with the answer when they reach the end; half of the rows
    do), at their true positions. The elided lines are what a compressed KV cache drops: training on such
    contexts teaches the model to rely only on the prompt and the recent lines. Loss on every kept line but
    the first (whose previous line is elided) and on the answer."""
    rng = np.random.default_rng(seed)
    line_len = len(f"01:{'0' * SUM_DIGITS}\n")
    rows, positions, masks = [], [], []
    for problem in problems:
        prompt = encode_chat(problem.question)
        ids = encode_chat(problem.question, problem.solution())
        first = problem.b - lines if rng.random() < 0.5 else int(rng.integers(0, problem.b - lines + 1))
        cut = len(prompt) + line_len * first
        end = cut + line_len * lines if first < problem.b - lines else len(ids)
        kept = list(range(len(prompt))) + list(range(cut, end))
        kept += [kept[-1]] * (len(prompt) + line_len * lines + len(ids) - cut - line_len * (problem.b - first) - len(kept))
        rows.append([ids[i] for i in kept])
        positions.append(kept)
        mask = np.zeros(len(kept) - 1, np.float32)
        mask[len(prompt) - 1 + (line_len if first else 0) : end - cut + len(prompt) - 1] = 1.0
        masks.append(mask)
    return np.array(rows, np.int32), np.array(positions, np.int32), np.array(masks)


def loss_fn(params: Params, cfg: ModelConfig, tokens, mask, positions=None):
    compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits = forward_dense(compute, cfg, tokens[:, :-1], None if positions is None else positions[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(losses * mask) / jnp.sum(mask)


def make_optimizer(args):
    """AdamW without its learning rate: the rate is passed per step, so the schedule may be sized at run time."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.98),
                       optax.add_decayed_weights(args.weight_decay))


def learning_rate(step: int, total: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to 1 % of it at `total` (warmup does not depend on `total`)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.01 + 0.99 * 0.5 * (1.0 + np.cos(np.pi * progress)))


@partial(jax.jit, static_argnums=(1, 2), donate_argnums=(0, 3))
def train_step(params, cfg, optimizer, opt_state, tokens, mask, lr, positions=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, cfg, tokens, mask, positions)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p - lr * u, params, updates), opt_state, loss


@partial(jax.jit, static_argnums=(1,))
def teacher_forced_match(params, cfg, tokens, mask):
    """Per row: does the argmax at every assistant position equal the reference token?

    True exactly when greedy decoding reproduces the reference solution token for token.
    """
    logits = forward_dense(params, cfg, tokens[:, :-1])
    hit = (jnp.argmax(logits, axis=-1) == tokens[:, 1:]) | (mask == 0)
    return jnp.all(hit, axis=-1)


@partial(jax.jit, static_argnums=(1, 3))
def greedy_decode(params, cfg, prompts, prompt_len: int):
    """KV-free greedy decoding of equal-length prompts [B, prompt_len] into a [B, SEQ_LEN] buffer.

    Each step runs the causal forward over the whole buffer (later slots cannot influence earlier logits)
    and writes the argmax after the last filled position; rows stop at <|im_end|>.
    """
    batch = prompts.shape[0]
    buf = jnp.full((batch, SEQ_LEN), PAD_ID, jnp.int32).at[:, :prompt_len].set(prompts)

    def cond(state):
        t, _, done = state
        return (t < SEQ_LEN) & ~jnp.all(done)

    def body(state):
        t, buf, done = state
        logits = forward_dense(params, cfg, buf)
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, axis=1, keepdims=False), axis=-1)
        nxt = jnp.where(done, PAD_ID, nxt).astype(jnp.int32)
        buf = jax.lax.dynamic_update_index_in_dim(buf, nxt, t, axis=1)
        return t + 1, buf, done | (nxt == IM_END_ID)

    _, buf, _ = jax.lax.while_loop(cond, body, (jnp.int32(prompt_len), buf, jnp.zeros((batch,), bool)))
    return buf


def decode_text(ids) -> str:
    from zipage_jax.tasks.tokenizer import VOCAB

    inverse = {i: t for t, i in VOCAB.items()}
    out = []
    for i in ids:
        if i in (IM_END_ID, PAD_ID):
            break
        out.append(inverse.get(int(i), ""))
    return "".join(out)


def evaluate(params: Params, cfg: ModelConfig, problems: list[Problem], greedy_samples: int) -> dict:
    """In f32 on the shipped (bf16) weights: on every problem, whether greedy decoding reproduces the reference
    solution (teacher-forced argmax, exact); on the first `greedy_samples`, true greedy decoding."""
    shipped = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    tokens, mask = encode_batch(problems)
    prompt_len = len(encode_chat(problems[0].question))
    with jax.default_matmul_precision("highest"):
        exact = np.concatenate([
            np.asarray(teacher_forced_match(shipped, cfg, jnp.asarray(tokens[i : i + 25]), jnp.asarray(mask[i : i + 25])))
            for i in range(0, len(problems), 25)])
        out = np.asarray(greedy_decode(shipped, cfg, jnp.asarray(tokens[:greedy_samples, :prompt_len]), prompt_len))
    texts = [decode_text(row[prompt_len:]) for row in out] if greedy_samples else []
    sampled = problems[:greedy_samples]
    return {
        "problems": len(problems),
        "greedy_reproduces_reference": float(np.mean(exact)),
        "greedy_samples": greedy_samples,
        "greedy_samples_answer_accuracy": float(np.mean([boxed_answer(t) == p.answer for t, p in zip(texts, sampled)] or [0])),
        "greedy_samples_equal_reference": float(np.mean([t == p.solution() for t, p in zip(texts, sampled)] or [0])),
        "mean_output_tokens": float(np.mean([len(t) + 1 for t in texts] or [0])),
        "samples": [{"question": p.question, "answer": p.answer, "output": t} for p, t in zip(sampled, texts)],
    }


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    arch = architecture(args)
    from transformers import Qwen3Config

    cfg = ModelConfig.from_hf_config(Qwen3Config(**qwen3_hf_config(arch)))
    if args.init is None:
        params = init_random_params(cfg, jax.random.key(args.seed), jnp.float32)
    else:
        if ModelConfig.from_pretrained(args.init) != cfg:
            raise ValueError(f"--init: {args.init} does not have the architecture given by the arguments")
        params = load_hf_weights(args.init, cfg, jnp.float32)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"params: {n_params:,}  devices: {jax.devices()}", flush=True)
    optimizer = make_optimizer(args)
    opt_state = optimizer.init(params)

    log = {"args": vars(args), "params": n_params, "loss": []}
    start = time.time()
    total = args.steps
    step = 0
    while step < total:
        problems = sample_problems(args.batch, seed=args.seed * 1_000_003 + step, split="train")
        if args.window_lines is None:
            (tokens, mask), positions = encode_batch(problems, args.answer_only), None
        else:
            tokens, positions, mask = encode_window_batch(problems, args.window_lines, seed=args.seed * 1_000_003 + step)
        lr = jnp.float32(learning_rate(step, total, args))
        params, opt_state, loss = train_step(params, cfg, optimizer, opt_state, jnp.asarray(tokens),
                                             jnp.asarray(mask), lr, positions)
        if step == 4 and args.train_seconds is not None:
            jax.block_until_ready(params)
            warm_start = time.time()
        if step == TIMING_STEPS + 4 and args.train_seconds is not None:
            jax.block_until_ready(params)
            per_step = (time.time() - warm_start) / TIMING_STEPS
            fit = int((args.train_seconds - (time.time() - start)) / per_step) + step + 1
            total = max(step + 1, min(total, fit))
            print(f"{per_step * 1000:.1f} ms/step -> training {total} steps (--steps {total})", flush=True)
        if step % args.log_every == 0 or step == total - 1:
            loss = float(loss)
            elapsed = time.time() - start
            log["loss"].append([step, loss, round(elapsed, 1)])
            print(f"step {step:5d}  loss {loss:.4f}  lr {float(lr):.2e}  {elapsed:7.1f}s", flush=True)
        step += 1
    jax.block_until_ready(params)
    log["steps_done"] = total
    log["train_seconds"] = round(time.time() - start, 1)

    save_hf_checkpoint(params, arch, out, dtype="bfloat16")
    t0 = time.time()
    log["eval"] = evaluate(params, cfg, sample_problems(args.eval_problems, seed=args.seed + 12345, split="test"),
                           args.greedy_samples)
    log["eval_seconds"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in log["eval"].items() if k != "samples"}), flush=True)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
