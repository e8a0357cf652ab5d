"""Check that HF transformers loads the shipped tiny model and reproduces our greedy outputs.

Run with the torch venv (transformers + torch), not the project venv:

    /work/torchvenv/bin/python scripts/check_tiny_with_hf.py [--model DIR] [--log DIR/train_log.json]

HF greedy generation (f32) runs on the first --problems test problems of the repeated-addition task and is
compared with the reference solution; our JAX forward reproduces exactly the reference solutions that
tests/test_tiny_model.py checks (seed 2024), so equal-to-reference means equal to ours. Where a
train_log.json with our greedy generations exists (--log), HF is compared with those too. Prints one line
per problem and a JSON summary; exits 1 when HF differs from our outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "zipage_jax" / "assets" / "tiny-reasoner"


def _task_module():
    """The task generator loaded by file: importing the package would need jax, absent from the torch venv."""
    path = Path(__file__).resolve().parents[1] / "zipage_jax" / "tasks" / "repeated_addition.py"
    spec = importlib.util.spec_from_file_location("repeated_addition", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--log", type=Path, default=None, help="train_log.json with our greedy samples")
    p.add_argument("--problems", type=int, default=4)
    p.add_argument("--seed", type=int, default=2024)
    args = p.parse_args(argv)
    sample_problems = _task_module().sample_problems

    samples = [{"question": q.question, "answer": q.answer, "reference": q.solution()}
               for q in sample_problems(args.problems, seed=args.seed, split="test")]
    if args.log is not None:
        evals = json.loads(args.log.read_text())["eval"]  # one report, or one per task
        samples += [s for report in (evals.values() if "samples" not in evals else [evals]) for s in report["samples"]]

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    results = []
    for sample in samples:
        prompt = tok.apply_chat_template([{"role": "user", "content": sample["question"]}],
                                         tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=832 - ids.shape[1], do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        result = {"question": sample["question"], "hf_correct": bool(boxed) and boxed[-1] == sample["answer"]}
        if "reference" in sample:
            result["hf_equals_reference"] = text == sample["reference"]
        else:
            result["hf_equals_our_greedy"] = text == sample["output"]
        results.append(result)
        print(results[-1], flush=True)
    summary = {"problems": len(results),
               "hf_correct": sum(r["hf_correct"] for r in results),
               "hf_equals_reference": sum(r.get("hf_equals_reference", False) for r in results),
               "hf_equals_our_greedy": sum(r.get("hf_equals_our_greedy", False) for r in results),
               "our_greedy_samples": sum("hf_equals_our_greedy" in r for r in results)}
    print(json.dumps(summary))
    return 0 if summary["hf_equals_our_greedy"] == summary["our_greedy_samples"] else 1


if __name__ == "__main__":
    sys.exit(main())
