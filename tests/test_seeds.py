"""The suite's seeds (tests/seeds.py): fixed per test and draw by default, fresh under ``--seed random``, one
replayed value under ``--seed N``; and Hypothesis derandomized in CI."""

import pytest
from hypothesis import settings

import seeds


def draws(monkeypatch, mode, test_id, count=3):
    monkeypatch.setattr(seeds, "mode", mode)
    monkeypatch.setattr(seeds, "test_id", test_id)
    monkeypatch.setattr(seeds, "used", [])
    return [seeds.fresh_seed() for _ in range(count)]


def test_fixed_seeds_repeat_per_test_and_draw(monkeypatch):
    first = draws(monkeypatch, "fixed", "tests/test_x.py::test_a")
    assert draws(monkeypatch, "fixed", "tests/test_x.py::test_a") == first  # every run the same
    assert len(set(first)) == 3  # each draw its own
    assert draws(monkeypatch, "fixed", "tests/test_x.py::test_b") != first  # each test its own
    assert seeds.used == draws(monkeypatch, "fixed", "tests/test_x.py::test_b")  # what a failure prints


def test_random_and_replayed_seeds(monkeypatch):
    assert len(set(draws(monkeypatch, "random", "t") + draws(monkeypatch, "random", "t"))) == 6
    assert draws(monkeypatch, 1234, "t") == [1234] * 3
    assert [seeds.parse_mode(v) for v in ("fixed", "random", "77")] == ["fixed", "random", 77]
    with pytest.raises(ValueError, match="--seed"):
        seeds.parse_mode("often")


def test_hypothesis_runs_derandomized_without_deadlines_in_ci():
    if seeds.mode == "random":
        pytest.skip("--seed random explores: Hypothesis draws fresh examples")
    assert settings.default.derandomize and settings.default.deadline is None and settings.default.database is None
