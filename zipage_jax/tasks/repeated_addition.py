"""Multiplication by repeated addition: the synthetic long-reasoning task of the shipped tiny model.

Problem: "What is A*B?" with A a 5-digit and B a 2-digit number (40..70) whose product has 7 digits.
Reasoning: B lines `kk:SSSSSSS`, line k holding the running sum k*A as 7 digits written least significant
digit first (so each digit needs only the carry of the digit before it), then `\\boxed{A*B}`.

Why this shape: every line adds A, whose digits exist only in the prompt, and the model must compare its
line counter with B (also only in the prompt) to know when to stop. So each line looks far back at a few
prompt tokens (attended strongly, line after line) and at the previous line's sum; nothing else of the
history matters. A KV cache that keeps only a recent window loses A after ~150 tokens and fails, while
attention-score eviction keeps the few prompt digits the model keeps reading.

Splits are fixed by a hash of the problem, so train and test never overlap for any seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import numpy as np

A_DIGITS = 5
B_MIN, B_MAX = 40, 70
SUM_DIGITS = 7
TEST_FRACTION_INV = 16  # one problem in 16 belongs to the test split
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    b: int

    def __post_init__(self):
        if not 10 ** (A_DIGITS - 1) <= self.a < 10**A_DIGITS:
            raise ValueError(f"a must have {A_DIGITS} digits, got {self.a}")
        if not B_MIN <= self.b <= B_MAX:
            raise ValueError(f"b must be in [{B_MIN}, {B_MAX}], got {self.b}")
        if not 10 ** (SUM_DIGITS - 1) <= self.a * self.b < 10**SUM_DIGITS:
            raise ValueError(f"a*b must have {SUM_DIGITS} digits, got {self.a * self.b}")

    @property
    def question(self) -> str:
        return f"What is {self.a}*{self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    @property
    def split(self) -> str:
        return split_of(f"{self.a}*{self.b}")

    @property
    def conclusion(self) -> str:
        """The end of `solution()` computed once from the finished scratchpad: here the boxed product (the last
        sum reversed). Training weights it up and checks it given the reference scratchpad."""
        return f"\\boxed{{{self.answer}}}"

    def solution(self) -> str:
        """The reference reasoning: one line per partial sum, then the boxed product."""
        lines = [f"{k:02d}:{reversed_digits(k * self.a)}\n" for k in range(1, self.b + 1)]
        return "".join(lines) + self.conclusion


def reversed_digits(value: int) -> str:
    """A running sum as the traces write it: ``SUM_DIGITS`` digits, least significant first (the order a model
    adds them in)."""
    return str(value).zfill(SUM_DIGITS)[::-1]


def split_of(key: str) -> str:
    """The split a problem belongs to, by a hash of ``key`` (its question): one in ``TEST_FRACTION_INV`` is test."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_FRACTION_INV == 0 else "train"


def check_sample_request(n: int, split: str):
    """The arguments every task's ``sample_problems`` takes: ``n >= 0`` problems of one of ``SPLITS``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def sample_problems(n: int, seed: int, split: str) -> list[Problem]:
    """`n` problems of `split`, drawn deterministically from `seed` (duplicates possible, as in i.i.d. data)."""
    check_sample_request(n, split)
    rng = np.random.default_rng(seed)
    problems: list[Problem] = []
    while len(problems) < n:
        b = int(rng.integers(B_MIN, B_MAX + 1))
        a = int(rng.integers(-(-(10 ** (SUM_DIGITS - 1)) // b), 10**A_DIGITS))
        problem = Problem(a, b)
        if problem.split == split:
            problems.append(problem)
    return problems


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, or None when there is none."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None
