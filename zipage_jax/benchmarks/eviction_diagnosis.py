"""Where compression breaks the interleaved-sums task, and which evicted tokens break it.

Runs held-out problems greedily under one budget with an `EvictionTrace`, finds each output's first wrong
scratchpad line, and for that line (and the same line of the problems that got it right) reports how many
(token, layer, KV head) triples of each input the line needs were still held when its first digit was computed
(and per layer for the gap line): the
multiplicand's digits in the prompt, the previous line of the same multiplication (after a gap at a block's
start) and the line just above: `python -m zipage_jax.bench eviction-diagnosis` (CPU is enough for the tiny model):

    python -m zipage_jax.bench eviction-diagnosis --model zipage_jax/assets/tiny-reasoner-two-tasks \
        --problems 48 --budget 10 [--set decay=0.5 ...]
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from zipage_jax.benchmarks.eviction_trace import EvictionTrace
from zipage_jax.benchmarks.sweep import parse_value
from zipage_jax.engine.llm import LLM
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.tasks import interleaved_sums
from zipage_jax.tasks.tokenizer import encode_chat

QUESTION_OFFSET = 6  # <|im_start|> "user\n" precede the question in encode_chat


def line_inputs(problem, prompt_len: int) -> list[dict]:
    """Per scratchpad line: its kind, the position of its first digit, and the positions of what it reads."""
    text = problem.solution()
    starts = np.cumsum([0] + [len(line) + 1 for line in text.split("\n")])[:-1]
    q = problem.question  # "What is A*B+C*D?"
    operand = {"X": q.index(" ") + 4, "Y": q.index("+") + 1}  # A after "What is ", C after "+"

    def digits(line: int) -> list[int]:  # a line is "Xkk:" then 7 digits
        return list(range(prompt_len + starts[line] + 4, prompt_len + starts[line] + 11))

    order, seen, rows = problem.lines(), {}, []
    for i, (name, _) in enumerate(order):
        reads = {"multiplicand": [QUESTION_OFFSET + operand[name] + d for d in range(5)]}
        if i > 0:
            reads["line above"] = digits(i - 1)
        if name in seen and seen[name] != i - 1:
            reads["same name, after a gap"] = digits(seen[name])
        kind = "block start" if i > 0 and order[i - 1][0] != name else "in block"
        rows.append(dict(kind=kind, at=digits(i)[0], reads=reads))
        seen[name] = i
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zipage_jax.bench eviction-diagnosis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="zipage_jax/assets/tiny-reasoner-two-tasks")
    p.add_argument("--problems", type=int, default=48)
    p.add_argument("--budget", type=int, default=10, help="kv_budget_pages (pages of 16)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="engine/scoring override")
    p.add_argument("--output", default=None, help="write the per-problem rows as JSON")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    llm = LLM(args.model, page_size=16, attention_backend="reference", compression=True,
              kv_budget_pages=args.budget, max_num_seqs=max(args.problems, 1), **overrides)
    trace = EvictionTrace(llm)
    problems = interleaved_sums.sample_problems(args.problems, seed=0, split="test")
    prompts = [encode_chat(pr.question) for pr in problems]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1024), use_tqdm=False)

    firsts, rows = [], []
    for pr, out in zip(problems, outputs):
        ref, got = pr.solution().split("\n"), out.outputs[0].text.split("\n")
        wrong = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        firsts.append(wrong)
        rows.append(dict(question=pr.question, first_wrong_line=wrong, correct=out.outputs[0].text == pr.solution()))
    inputs = [line_inputs(pr, len(prompt)) for pr, prompt in zip(problems, prompts)]
    where = collections.Counter("none" if w is None else "conclusion" if w >= len(lines) else lines[w]["kind"]
                                for w, lines in zip(firsts, inputs))
    print(f"{args.problems} problems, budget {args.budget} pages of 16, {overrides or 'defaults'}: "
          f"{sum(r['correct'] for r in rows)} correct; first wrong line: {dict(where)}")
    print("first wrong line index:", dict(sorted(collections.Counter(w for w in firsts if w is not None).items())))

    # at each failing line index, the held share of each input: failing problems vs problems right at that line
    print("\n| line | outcome | n | " + " | ".join(["multiplicand", "line above", "same name, after a gap"]) +
          " | gap line by layer |")
    print("|---|---|---:|---:|---:|---:|---|")
    for line in sorted({w for w in firsts if w is not None and w < min(map(len, inputs))}):
        for outcome in ("wrong here", "right here"):
            chosen = [j for j, w in enumerate(firsts) if (w == line) == (outcome == "wrong here")
                      and (w is None or w >= line)]
            shares = collections.defaultdict(list)
            for j in chosen:
                rid, info = outputs[j].request_id, inputs[j][line]
                for name, positions in info["reads"].items():
                    held = np.stack([trace.held(f"{rid}-0", q, info["at"]) for q in positions])  # [tokens, L, H]
                    shares[name].append(held.mean(axis=(0, 2)))  # per layer: share of (token, head) held
            cells = [f"{100 * np.mean(shares[k]):.0f} %" if shares[k] else "" for k in
                     ("multiplicand", "line above", "same name, after a gap")]
            gap = shares["same name, after a gap"]
            by_layer = " / ".join(f"{100 * v:.0f}" for v in np.mean(gap, axis=0)) if gap else ""
            print(f"| {line} | {outcome} | {len(chosen)} | " + " | ".join(cells) + f" | {by_layer} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return dict(args=vars(args), rows=rows)
