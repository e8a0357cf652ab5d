"""The seeds of every random input in the suite: fixed in CI, fresh on request, printed when a test fails.

Every random input comes from `fresh_seed()` or `seeded_rng()` (a new seed per draw). `pytest --seed` picks them:

- `fixed` (the default, what CI runs): a test's k-th draw is a hash of its node id and k, the same on every run
  and machine, so a CI failure is a regression, never an unlucky draw;
- `random`: fresh entropy on every draw: an opt-in run that explores inputs CI never tries
  (`python -m pytest -n 2 --seed random`);
- an integer N: every draw is N, replaying the failure that printed it.

A failing test prints the seeds it drew (conftest). Hypothesis follows the same switch: its `ci` profile (examples
derived from each test, no example database, no deadline) by default, `explore` (fresh examples) under
`--seed random`; a falsifying example is printed in full either way.
"""

import zlib

import numpy as np

used: list[int] = []  # the current test's seeds, reset by conftest before each test
mode: str | int = "fixed"  # set by `--seed`: "fixed", "random" or the seed to replay
test_id = ""  # the running test's node id (conftest)


def parse_mode(text: str) -> str | int:
    """`--seed`'s value: fixed, random or an integer."""
    if text in ("fixed", "random"):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--seed: expected fixed, random or an integer, got {text!r}") from None


def fresh_seed() -> int:
    """The seed of the next random input (see the module docstring for where it comes from)."""
    if isinstance(mode, int):
        seed = mode
    elif mode == "random":
        seed = int(np.random.SeedSequence().entropy % 2**31)
    else:
        seed = zlib.crc32(f"{test_id}#{len(used)}".encode()) % 2**31
    used.append(seed)
    return seed


def seeded_rng() -> np.random.Generator:
    return np.random.default_rng(fresh_seed())
