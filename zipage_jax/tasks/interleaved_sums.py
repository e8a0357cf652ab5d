"""Two interleaved multiplications: the synthetic task of the shipped tiny model where importance moves.

Problem: "What is A*B+C*D?" with A, C 5-digit numbers and B, D in 16..30. Reasoning: the two running sums of
the repeated-addition task (`repeated_addition`) in alternating blocks of `BLOCK` lines, `Xkk:SSSSSSS` for
k*A and `Ykk:SSSSSSS` for k*C (7 digits, least significant first); once one multiplication is done the other
runs to its end; then the conclusion: the last line of the multiplication that finished first, recalled
(copied) from far back, `Sum:SSSSSSS`, the sum of the two lines above it, and `\\boxed{A*B+C*D}`.

Why this shape: while a Y block runs, nothing reads A's digits in the prompt or the last X line, yet the next
X block needs both, and the final sum needs the last line of the multiplication that finished first, often
150+ tokens after anything looked at it. Tokens that were attended strongly go quiet for a long stretch and
then become essential again: a score that forgets at once (the current window's attention alone) evicts them
while they are quiet, a decayed history of past attention can keep them, and a recent window loses the prompt.

Splits are fixed by a hash of the problem, so train and test never overlap for any seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zipage_jax.tasks.repeated_addition import boxed_answer, check_sample_request, reversed_digits, split_of

A_DIGITS = 5
B_MIN, B_MAX = 16, 30
BLOCK = 6  # lines of one multiplication before the reasoning switches to the other

__all__ = ["InterleavedProblem", "boxed_answer", "sample_problems"]


@dataclasses.dataclass(frozen=True)
class InterleavedProblem:
    a: int
    b: int
    c: int
    d: int

    def __post_init__(self):
        for name in ("a", "c"):
            if not 10 ** (A_DIGITS - 1) <= getattr(self, name) < 10**A_DIGITS:
                raise ValueError(f"{name} must have {A_DIGITS} digits, got {getattr(self, name)}")
        for name in ("b", "d"):
            if not B_MIN <= getattr(self, name) <= B_MAX:
                raise ValueError(f"{name} must be in [{B_MIN}, {B_MAX}], got {getattr(self, name)}")

    @property
    def question(self) -> str:
        return f"What is {self.a}*{self.b}+{self.c}*{self.d}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b + self.c * self.d)

    @property
    def split(self) -> str:
        return split_of(self.question)

    def lines(self) -> list[tuple[str, int]]:
        """(name, k) of every scratchpad line in order: blocks of BLOCK lines, X first, then whichever is left."""
        todo = {"X": self.b, "Y": self.d}
        done = {"X": 0, "Y": 0}
        order, name = [], "X"
        while done["X"] < todo["X"] or done["Y"] < todo["Y"]:
            if done[name] == todo[name]:
                name = "Y" if name == "X" else "X"
            for _ in range(min(BLOCK, todo[name] - done[name])):
                done[name] += 1
                order.append((name, done[name]))
            name = "Y" if name == "X" else "X"
        return order

    def recalled_lines(self) -> list[int]:
        """Indices (in ``solution().split("\\n")``) of the lines read again after a gap: each block's last line,
        which the same multiplication's next block, or the final sum, continues from."""
        order = self.lines()
        return [i for i, (name, _) in enumerate(order) if i + 1 == len(order) or order[i + 1][0] != name]

    @property
    def conclusion(self) -> str:
        """The end of `solution()` computed once from the finished scratchpad: the recall line (a copy of the last
        line of the multiplication that finished first, often 150+ tokens back), the `Sum:` line (the two lines
        above it added) and the boxed result. Why the copy: adding a line found far back in one step stayed at
        chance in training (the sum's digits sat at ~2 nats each while every scratchpad line was right), whereas
        copying a line by its tag and adding two adjacent lines reuse what the scratchpad already needs; the
        recalled tokens still have to survive every eviction until the end. `Sum:` has the width of a line tag,
        so the digits to add sit one and two lines (12 and 24 tokens) back, as the running sums' do."""
        last = self.lines()[-1][0]
        other, k = ("Y", self.d) if last == "X" else ("X", self.b)
        recalled = k * (self.c if other == "Y" else self.a)
        return (f"{other}{k:02d}:{reversed_digits(recalled)}\nSum:{reversed_digits(self.a * self.b + self.c * self.d)}\n"
                f"\\boxed{{{self.answer}}}")

    def solution(self) -> str:
        """The reference reasoning: the interleaved running sums, then the conclusion."""
        factor = {"X": self.a, "Y": self.c}
        return "".join(f"{name}{k:02d}:{reversed_digits(k * factor[name])}\n" for name, k in self.lines()) + self.conclusion


def sample_problems(n: int, seed: int, split: str) -> list[InterleavedProblem]:
    """`n` problems of `split`, drawn deterministically from `seed` (duplicates possible, as in i.i.d. data)."""
    check_sample_request(n, split)
    rng = np.random.default_rng(seed)
    problems: list[InterleavedProblem] = []
    while len(problems) < n:
        a, c = (int(x) for x in rng.integers(10 ** (A_DIGITS - 1), 10**A_DIGITS, size=2))
        b, d = (int(x) for x in rng.integers(B_MIN, B_MAX + 1, size=2))
        problem = InterleavedProblem(a, b, c, d)
        if problem.split == split:
            problems.append(problem)
    return problems
