"""A product stored early and needed only at the end: the synthetic task where an old step matters.

Problem: "Let P=A*B. What is P+C*D?" with A, C 5-digit numbers, B in 4..8 and D in 36..50. Reasoning: the running
sums of A (`Akk:SSSSSSS`, 7 digits least significant first, as in `repeated_addition`), then P stated once
(`Mem:SSSSSSS`, a copy of the last A line), then the running sums of C (`Ckk:SSSSSSS`, the distractor lines:
none of them reads P), then the conclusion: P recalled (`Mem:` again, copied by its tag from 430+ tokens back),
`Sum:SSSSSSS` (the two lines above it added, as in `interleaved_sums`) and `\\boxed{P+C*D}`.

Why this shape: P exists only in the first lines of the trace; the prompt holds A and B but not P (a tiny model
cannot multiply in one step), and between P and its use lie D >= 36 lines that never attend to it. So a cache of
the prompt plus a recent window (36 lines = 432 tokens are more than half of any output) cannot answer, and
an attention score computed from recent queries sees nothing reading P: only a scorer that values the old step
for what it is can keep it. Every line is 12 tokens wide, so the sum's digits sit one and two lines back, at the
running sums' offsets.

Splits are fixed by a hash of the problem, so train and test never overlap for any seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zipage_jax.tasks.repeated_addition import boxed_answer, check_sample_request, reversed_digits, split_of

A_DIGITS = 5
B_MIN, B_MAX = 4, 8
D_MIN, D_MAX = 36, 50

__all__ = ["StoredProblem", "boxed_answer", "sample_problems"]


@dataclasses.dataclass(frozen=True)
class StoredProblem:
    a: int
    b: int
    c: int
    d: int

    def __post_init__(self):
        for name in ("a", "c"):
            if not 10 ** (A_DIGITS - 1) <= getattr(self, name) < 10**A_DIGITS:
                raise ValueError(f"{name} must have {A_DIGITS} digits, got {getattr(self, name)}")
        if not B_MIN <= self.b <= B_MAX:
            raise ValueError(f"b must be in [{B_MIN}, {B_MAX}], got {self.b}")
        if not D_MIN <= self.d <= D_MAX:
            raise ValueError(f"d must be in [{D_MIN}, {D_MAX}], got {self.d}")

    @property
    def stored(self) -> int:
        """P = A*B, the intermediate result computed in the first lines."""
        return self.a * self.b

    @property
    def question(self) -> str:
        return f"Let P={self.a}*{self.b}. What is P+{self.c}*{self.d}?"

    @property
    def answer(self) -> str:
        return str(self.stored + self.c * self.d)

    @property
    def split(self) -> str:
        return split_of(self.question)

    def check(self, text: str) -> bool:
        """Whether `text` ends in the right boxed answer (what the eval's exact boxed match decides too)."""
        return boxed_answer(text) == self.answer

    def recalled_lines(self) -> list[int]:
        """Indices (in ``solution().split("\\n")``) of the lines read again after a gap: the A block's last line
        and the `Mem:` line, which hold P."""
        return [self.b - 1, self.b]

    @property
    def conclusion(self) -> str:
        """The end of `solution()` computed once from the finished scratchpad: P recalled, the `Sum:` line (the
        two lines above it added) and the boxed result."""
        return f"Mem:{reversed_digits(self.stored)}\nSum:{reversed_digits(int(self.answer))}\n\\boxed{{{self.answer}}}"

    def solution(self) -> str:
        """The reference reasoning: A's running sums, P stored, C's running sums, then the conclusion."""
        lines = [f"A{k:02d}:{reversed_digits(k * self.a)}\n" for k in range(1, self.b + 1)]
        lines.append(f"Mem:{reversed_digits(self.stored)}\n")
        lines += [f"C{k:02d}:{reversed_digits(k * self.c)}\n" for k in range(1, self.d + 1)]
        return "".join(lines) + self.conclusion


def sample_problems(n: int, seed: int, split: str) -> list[StoredProblem]:
    """`n` problems of `split`, drawn deterministically from `seed` (duplicates possible, as in i.i.d. data).
    Problems where C divides P, or P is written in the question, are redrawn: P's digits then appear nowhere
    but in its own lines."""
    check_sample_request(n, split)
    rng = np.random.default_rng(seed)
    problems: list[StoredProblem] = []
    while len(problems) < n:
        a, c = (int(x) for x in rng.integers(10 ** (A_DIGITS - 1), 10**A_DIGITS, size=2))
        b, d = int(rng.integers(B_MIN, B_MAX + 1)), int(rng.integers(D_MIN, D_MAX + 1))
        problem = StoredProblem(a, b, c, d)
        if problem.split == split and problem.stored % c and str(problem.stored) not in problem.question:
            problems.append(problem)
    return problems
