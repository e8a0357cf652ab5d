"""Test-session setup: four simulated CPU devices so tensor-parallel paths run on CPU (must precede jax import);
one jax compilation cache for the session's processes; the seeds of random inputs and Hypothesis's profiles
(tests/seeds.py: fixed in CI, `--seed random` explores)."""

import os
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests build engines of the same model and shapes: the programs one compiles, the others load. A fresh
# directory per run (xdist's workers share it), so no run reads another's programs.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"solo-{os.getpid()}"
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "zipage_jax_tests", _RUN))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from hypothesis import settings  # noqa: E402

import seeds  # noqa: E402

# CI: the same examples on every run (derived from each test), nothing remembered between runs, no deadline (a
# loaded 2-core machine is slow at random); explore: fresh examples every run
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, deadline=None, print_blob=True)


def pytest_addoption(parser):
    parser.addoption("--seed", type=seeds.parse_mode, default="fixed",
                     help="seeds of random inputs: fixed (default, CI), random (explore new ones) or N (replay a "
                          "failure: every seed is N); Hypothesis is derandomized unless random")


def pytest_configure(config):
    seeds.mode = config.getoption("--seed")
    settings.load_profile("explore" if seeds.mode == "random" else "ci")


# The longest test files, longest first (CPU seconds on a 2-core machine; tail of the list ~20 s). With
# `--dist loadfile` each file runs whole on one worker in collection order: started first, they leave the short
# files to fill both workers at the end, instead of one long file running alone after the rest is done.
LONGEST_FIRST = ("test_serve.py", "test_engine.py", "test_compaction_kernel.py", "test_kernels.py",
                 "test_compression_engine.py", "test_scoring_kernel.py", "test_readme.py", "test_fp8_kv.py",
                 "test_structured_server.py", "test_throughput_bench.py", "test_bench.py", "test_tensor_parallel.py",
                 "test_structured_outputs.py", "test_engine_process.py", "test_models.py", "test_compression_bench.py",
                 "test_compression_math.py", "test_notebooks.py", "test_serving_bench.py", "test_sweep.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept


@pytest.fixture(scope="module")
def without_jax_cache():
    """The executable store keeps only programs it compiled itself (one jax's cache hands back does not survive a
    second serialization): modules testing the store compile for real."""
    from jax._src import compilation_cache  # the switch is read once; reset_cache makes jax read it again

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    seeds.test_id = item.nodeid
    seeds.used.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and seeds.used:
        how = {"fixed": "a rerun draws the same", "random": "rerun with --seed N to make every draw N"}
        report.sections.append(("seeds", f"seeds used: {seeds.used} ({how.get(seeds.mode, '--seed')})"))
    return report
