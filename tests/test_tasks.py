"""The synthetic tasks: determinism, disjoint splits, verified solutions, lengths, tokenizer."""

import itertools
import re

import numpy as np
import pytest

from zipage_jax.tasks import TASKS, Problem, boxed_answer, interleaved_sums, sample_problems, stored_product
from zipage_jax.tasks.tokenizer import (IM_END_ID, build_tokenizer, chat_prompt, encode_chars, encode_chat,
                                       save_tokenizer)
from seeds import fresh_seed, seeded_rng


def test_sampling_is_deterministic_by_seed():
    first = sample_problems(50, seed=7, split="train")
    assert first == sample_problems(50, seed=7, split="train")
    assert first != sample_problems(50, seed=8, split="train")


def test_splits_never_overlap():
    train = {(p.a, p.b) for seed in range(3) for p in sample_problems(2000, seed=seed, split="train")}
    test = {(p.a, p.b) for seed in range(3) for p in sample_problems(300, seed=seed, split="test")}
    assert train and test and not train & test
    assert all(Problem(a, b).split == "test" for a, b in test)


def test_solution_lines_are_running_sums_and_box_holds_the_product():
    for p in sample_problems(100, seed=1, split="test"):
        text = p.solution()
        assert boxed_answer(text) == str(p.a * p.b)
        lines = text.split("\n")[:-1]
        assert len(lines) == p.b
        for k, line in enumerate(lines, start=1):
            counter, digits = line.split(":")
            assert int(counter) == k
            assert int(digits[::-1]) == k * p.a  # least significant digit first


def test_lengths_prompt_short_reasoning_long():
    problems = sample_problems(500, seed=3, split="train")
    prompt_lens = [len(encode_chat(p.question)) for p in problems]
    reasoning = [len(encode_chat(p.question, p.solution())) - n for p, n in zip(problems, prompt_lens)]
    assert max(prompt_lens) <= 64
    assert np.mean(reasoning) >= 512
    assert max(len(encode_chat(p.question, p.solution())) for p in problems) <= 832


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="split"):
        sample_problems(1, seed=0, split="valid")
    with pytest.raises(ValueError, match="a must"):
        Problem(123, 50)
    with pytest.raises(ValueError, match="b must"):
        Problem(12345, 7)


def test_conclusion_is_the_boxed_product_at_the_end():
    for p in sample_problems(20, seed=2, split="train"):
        assert p.conclusion == f"\\boxed{{{p.a * p.b}}}" and p.solution().endswith("\n" + p.conclusion)


def test_boxed_answer_takes_the_last_box():
    assert boxed_answer(r"x \boxed{12} then \boxed{ 345 }") == "345"
    assert boxed_answer("no box") is None


def test_tokenizer_is_char_level_and_matches_encode_chat(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    p = sample_problems(1, seed=5, split="test")[0]
    text = tok.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == chat_prompt(p.question)
    full = tok(text + p.solution() + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert full == encode_chat(p.question, p.solution())
    assert tok.eos_token_id == IM_END_ID
    assert tok.decode(full, skip_special_tokens=True) == re.sub(r"<\|[a-z_]+\|>", "", text) + p.solution()
    raw = build_tokenizer().encode("a b\n9").ids
    assert len(raw) == 5


# ---------------------------------------------------------------- interleaved sums (importance moves)

def test_interleaved_solution_alternates_blocks_and_sums_both_products():
    rng = seeded_rng()
    seed = int(rng.integers(1 << 30))
    problems = interleaved_sums.sample_problems(60, seed=seed, split="train")
    assert problems == interleaved_sums.sample_problems(60, seed=seed, split="train")
    for p in problems:
        text = p.solution()
        assert boxed_answer(text) == str(p.a * p.b + p.c * p.d), seed
        lines = text.split("\n")[:-1]
        total, recall = lines.pop(), lines.pop()
        assert total.startswith("Sum:") and int(total[4:][::-1]) == p.a * p.b + p.c * p.d
        # the recall line: the other multiplication's last line again, so the sum adds the two lines above it
        assert recall[0] != lines[-1][0] and recall == [line for line in lines if line[0] == recall[0]][-1]
        assert int(total[4:][::-1]) == int(recall[4:][::-1]) + int(lines[-1][4:][::-1])
        counters = {"X": 0, "Y": 0}
        names = []
        for line in lines:
            name, counter, digits = line[0], int(line[1:3]), line[4:]
            counters[name] += 1
            assert counter == counters[name] and line[3] == ":" and len(digits) == 7
            assert int(digits[::-1]) == counter * (p.a if name == "X" else p.c)
            names.append(name)
        assert counters == {"X": p.b, "Y": p.d}
        runs = [len(list(group)) for _, group in itertools.groupby(names)]
        assert names[0] == "X" and all(r == interleaved_sums.BLOCK for r in runs[:-2])
        # the lines read after a gap: each run's last line
        ends = list(np.cumsum(runs) - 1)
        assert p.recalled_lines() == ends
        # the conclusion: the recall line (copied after a gap), the Sum: line and the box
        assert text.endswith(p.conclusion) and p.conclusion == "\n".join(text.split("\n")[-3:])


def test_interleaved_splits_lengths_and_bad_inputs():
    train = {p.question for p in interleaved_sums.sample_problems(3000, seed=0, split="train")}
    test = {p.question for p in interleaved_sums.sample_problems(300, seed=0, split="test")}
    assert train and test and not train & test
    problems = interleaved_sums.sample_problems(500, seed=4, split="test")
    prompt = {len(encode_chat(p.question)) for p in problems}
    assert len(prompt) == 1 and prompt.pop() <= 64  # equal prompt lengths: the trainer's greedy eval batches them
    lengths = [len(encode_chat(p.question, p.solution())) for p in problems]
    assert max(lengths) <= 832 and np.mean(lengths) >= 512
    with pytest.raises(ValueError, match="c must"):
        interleaved_sums.InterleavedProblem(12345, 20, 1234, 20)
    with pytest.raises(ValueError, match="d must"):
        interleaved_sums.InterleavedProblem(12345, 20, 12345, 31)
    with pytest.raises(ValueError, match="split"):
        interleaved_sums.sample_problems(1, seed=0, split="dev")
    assert set(TASKS) == {"repeated_addition", "interleaved_sums", "stored_product"}


# ---------------------------------------------------------------- stored product (an old step matters)

def test_stored_product_is_deterministic_and_its_splits_disjoint():
    seed = fresh_seed()
    problems = stored_product.sample_problems(40, seed=seed, split="train")
    assert problems == stored_product.sample_problems(40, seed=seed, split="train")
    assert problems != stored_product.sample_problems(40, seed=seed + 1, split="train")
    train = {p.question for p in stored_product.sample_problems(2000, seed=0, split="train")}
    test = {p.question for p in stored_product.sample_problems(200, seed=0, split="test")}
    assert train and test and not train & test
    assert all(p.split == "test" for p in stored_product.sample_problems(50, seed=1, split="test"))


def test_stored_product_trace_and_checker():
    for p in stored_product.sample_problems(50, seed=fresh_seed(), split="test"):
        text = p.solution()
        assert p.check(text) and boxed_answer(text) == str(p.a * p.b + p.c * p.d)
        lines = text.split("\n")
        assert all(len(line) == 11 for line in lines[:-1])  # every line 12 tokens with its newline
        assert [int(line[1:3]) for line in lines[: p.b]] == list(range(1, p.b + 1))
        assert all(int(line[4:][::-1]) == (k + 1) * p.a for k, line in enumerate(lines[: p.b]))
        assert lines[p.b] == "Mem:" + lines[p.b - 1][4:] and p.recalled_lines() == [p.b - 1, p.b]
        c_lines = lines[p.b + 1 : -3]
        assert len(c_lines) == p.d and all(int(x[4:][::-1]) == (k + 1) * p.c for k, x in enumerate(c_lines))
        recall, total = lines[-3], lines[-2]
        assert recall == lines[p.b] and int(total[4:][::-1]) == int(recall[4:][::-1]) + int(c_lines[-1][4:][::-1])
        assert text.endswith("\n" + p.conclusion) and p.conclusion == "\n".join(lines[-3:])
        for wrong in (str(int(p.answer) + 1), p.answer[:-1], str(p.c * p.d), str(p.a * p.b)):
            assert not p.check(text.replace(f"{{{p.answer}}}", f"{{{wrong}}}"))
        assert not p.check(text[: -len(p.conclusion)])  # no box at all


def test_stored_product_lengths_and_bad_inputs():
    problems = stored_product.sample_problems(300, seed=6, split="train")
    prompt = {len(encode_chat(p.question)) for p in problems}
    assert len(prompt) == 1 and prompt.pop() <= 64  # equal prompt lengths: the trainer's greedy eval batches them
    lengths = [len(encode_chat(p.question, p.solution())) for p in problems]
    assert max(lengths) <= 832 and np.mean(lengths) - len(encode_chat(problems[0].question)) >= 512
    assert all(len(encode_chars(p.question + p.solution())) == len(p.question + p.solution()) for p in problems[:5])
    for args, field in (((1234, 5, 12345, 40), "a must"), ((12345, 9, 12345, 40), "b must"),
                        ((12345, 5, 123456, 40), "c must"), ((12345, 5, 12345, 51), "d must")):
        with pytest.raises(ValueError, match=field):
            stored_product.StoredProblem(*args)
    with pytest.raises(ValueError, match="split"):
        stored_product.sample_problems(1, seed=0, split="dev")


def test_prompt_and_recent_window_do_not_hold_the_stored_product():
    """The oracle of why recency fails: at the answer (the recall line's first token), the prompt plus the
    latest half of the mean output (twice the sweep's largest budget, 25 %) hold P in neither digit order."""
    problems = stored_product.sample_problems(200, seed=fresh_seed(), split="test")
    mean_output = np.mean([len(p.solution()) + 1 for p in problems])
    window = int(mean_output / 2)
    for p in problems:
        before_answer = p.solution()[: -len(p.conclusion)]
        visible = p.question + "\n" + before_answer[-window:]
        stored = str(p.stored)
        assert stored[::-1].ljust(7, "0") not in visible and stored not in visible, p
        assert stored[::-1].ljust(7, "0") in before_answer  # ... while the whole trace does
        # nor can any line in the window have read it: none of them is an A or Mem line
        assert not any(line[0] in "AM" for line in before_answer[-window:].split("\n")[1:] if line)
