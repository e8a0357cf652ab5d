"""Test-session setup: four simulated CPU devices so tensor-parallel paths run on CPU (must precede jax import)."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import pytest  # noqa: E402

import seeds  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None, help="replay a failure: every fresh seed is this one")


def pytest_configure(config):
    seeds.pinned = config.getoption("--seed")


@pytest.fixture(autouse=True)
def _reset_seeds():
    seeds.used.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and seeds.used:
        report.sections.append(("seeds", f"seeds used: {seeds.used}; replay one with --seed N"))
    return report
