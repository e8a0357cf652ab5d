"""Fresh seeds that a failing test reports, and that `pytest --seed N` replays.

Every random input in the suite comes from `fresh_seed()` or `seeded_rng()`: each test draws new inputs on every
run (so the suite keeps exploring), and conftest prints the seeds a failed test used.
"""

import numpy as np

used: list[int] = []  # the current test's seeds, reset by conftest before each test
pinned: int | None = None  # set by `--seed`


def fresh_seed() -> int:
    seed = pinned if pinned is not None else int(np.random.SeedSequence().entropy % 2**31)
    used.append(seed)
    return seed


def seeded_rng() -> np.random.Generator:
    return np.random.default_rng(fresh_seed())
