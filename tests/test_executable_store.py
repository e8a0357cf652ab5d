"""The executable store: a warm start loads the engine's programs without tracing or compiling them, in another
process; a corrupt or foreign entry is dropped and compiled again; the key follows what shapes a program."""

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from seeds import seeded_rng
from zipage_jax.config import EngineConfig
from zipage_jax.worker.executable_store import ExecutableStore, engine_fingerprint
from zipage_jax.worker.programs import Program, Programs

pytestmark = pytest.mark.usefixtures("without_jax_cache")  # these tests start engines on an executable store


class Events:
    """Counts jax's trace and compile events while alive."""

    def __init__(self):
        self.names = []
        self.active = True
        monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, name, duration, **kwargs):
        if self.active:
            self.names.append(name)

    def count(self, suffix):
        return sum(n.endswith(suffix) for n in self.names)


def _program(scale: float = 1.0) -> tuple[Program, np.ndarray]:
    x = seeded_rng().standard_normal((4, 8)).astype(np.float32)
    jitted = jax.jit(lambda a, *, scale: jnp.tanh(a * scale) @ a.T, static_argnames=("scale",))
    return Program(("toy", scale), f"toy x{scale}", jitted, (jnp.asarray(x),), static=dict(scale=scale)), x


def test_a_stored_program_loads_without_tracing_and_computes_the_same(tmp_path):
    program, x = _program()
    first = Programs(store=ExecutableStore(tmp_path, "fp"))
    want = np.asarray(first.run(program, jnp.asarray(x)))
    assert first.store.saved == 1
    events = Events()
    second = Programs(store=ExecutableStore(tmp_path, "fp"))
    got = np.asarray(second.run(program, jnp.asarray(x)))
    events.active = False
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.tanh(x) @ x.T, rtol=1e-4, atol=1e-4)
    assert second.store.loaded == 1 and second.store.saved == 0
    assert events.count("jaxpr_trace_duration") == 0 and events.count("backend_compile_duration") == 0


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "foreign file"])
def test_a_damaged_entry_is_dropped_and_compiled_again(tmp_path, damage):
    program, x = _program()
    store = ExecutableStore(tmp_path, "fp")
    Programs(store=store).run(program, jnp.asarray(x))
    path = store.path(program)
    blob = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        blob[-100] ^= 0xFF
    elif damage == "truncate":
        del blob[len(blob) // 2:]
    else:
        blob = bytearray(b"not an executable at all")
    path.write_bytes(bytes(blob))
    again = Programs(store=ExecutableStore(tmp_path, "fp"))
    got = np.asarray(again.run(program, jnp.asarray(x)))
    np.testing.assert_allclose(got, np.tanh(x) @ x.T, rtol=1e-4, atol=1e-4)
    assert again.store.rejected == 1 and again.store.loaded == 0 and again.store.saved == 1
    assert ExecutableStore(tmp_path, "fp").load(program) is not None  # the fresh entry is whole


def test_pruning_drops_the_least_recently_used_entries(tmp_path):
    store = ExecutableStore(tmp_path, "fp")
    programs = [_program(scale=float(i))[0] for i in range(3)]
    runner = Programs(store=store)
    for i, program in enumerate(programs):
        runner.run(program, program.args[0])
        os.utime(store.path(program), (1000 + i, 1000 + i))  # program 0 is the oldest
    store.load(programs[0])  # ... until it is used again
    sizes = [store.path(p).stat().st_size for p in programs]
    store.prune(max_bytes=sizes[0] + sizes[2])
    assert [store.path(p).exists() for p in programs] == [True, False, True]


def test_keys_follow_what_shapes_a_program(tmp_path):
    program, _ = _program()
    store = ExecutableStore(tmp_path, "fp")
    assert store.key(program) == store.key(_program()[0])  # the same program, other values
    assert store.key(program) != store.key(_program(scale=2.0)[0])  # another static argument
    assert store.key(program) != ExecutableStore(tmp_path, "other").key(program)
    wider = dataclasses.replace(program, args=(jnp.zeros((4, 9), jnp.float32),))
    assert store.key(program) != store.key(wider)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    from zipage_jax.models.config import ModelConfig
    cfg = ModelConfig.from_pretrained("tests/fixtures/hf/qwen3")
    base = EngineConfig(model="a", page_size=16)

    def fingerprint(config, model_cfg=cfg):
        return engine_fingerprint(config, model_cfg, "reference", mesh)

    assert fingerprint(base) == fingerprint(dataclasses.replace(base, model="b", seed=7))  # host-only settings
    assert fingerprint(base) != fingerprint(dataclasses.replace(base, page_size=32))
    assert fingerprint(base) != fingerprint(dataclasses.replace(base, compression=True))
    assert fingerprint(base) != fingerprint(base, dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 2))


WARM_START = textwrap.dedent("""
    import json, sys
    from jax import monitoring
    events = []
    monitoring.register_event_duration_secs_listener(lambda name, d, **kw: events.append(name))
    from zipage_jax import LLM, SamplingParams
    llm = LLM("tests/fixtures/hf/qwen3", page_size=16, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, compilation_cache_dir=sys.argv[1], compression=True, kv_budget_pages=2)
    events.clear()
    report = llm.warmup(use_tqdm=False)
    out = llm.generate([[5, 6, 7, 8, 9] * 4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)
    store = llm.engine.worker.programs.store
    print(json.dumps(dict(programs=report["programs"], traces=sum(e.endswith("trace_duration") for e in events),
                          compiles=sum(e.endswith("backend_compile_duration") for e in events),
                          loaded=store.loaded, saved=store.saved, tokens=out[0].outputs[0].token_ids)))
""")


def test_a_second_process_on_the_same_store_traces_and_compiles_nothing(tmp_path):
    def start():
        proc = subprocess.run([sys.executable, "-c", WARM_START, str(tmp_path)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert cold["saved"] == cold["programs"] > 0 and cold["compiles"] >= cold["programs"]
    assert warm["loaded"] == warm["programs"] == cold["programs"] and warm["saved"] == 0
    assert warm["traces"] == 0 and warm["compiles"] == 0
    # 20 + 40 tokens in a 2-page budget: compressions ran on loaded programs (a small engine: 9 programs to store)
    assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == 40


def test_background_compiles_are_kept_apart_and_stop_when_asked(tmp_path):
    """``compile_in_background`` compiles (and stores) every program on its own thread, calls ``done`` after, and
    leaves ``compile_wall_s`` (what steps waited on) alone; a call then finds its program compiled. Asked to stop
    before it starts, it compiles nothing and still ends."""
    programs = [_program(scale) for scale in (1.0, 2.0, 3.0)]
    compiled = Programs(store=ExecutableStore(tmp_path, "fp"))
    ended = []
    compiled.compile_in_background([p for p, _ in programs], done=lambda: ended.append(True))
    compiled.join_background()
    assert ended == [True] and not compiled.compiling_in_background and not compiled.compiling_unused
    assert set(compiled.compiled) == {p.key for p, _ in programs} and compiled.store.saved == 3
    assert compiled.compile_wall_s == 0.0
    program, x = programs[1]
    np.testing.assert_allclose(np.asarray(compiled.run(program, jnp.asarray(x))), np.tanh(2 * x) @ x.T,
                               rtol=1e-4, atol=1e-4)
    assert compiled.compiled_on_use == 0

    stop = concurrent.futures.Future()
    stop.set_result(None)
    stopped = Programs()
    stopped.compile_in_background([p for p, _ in programs], stop=stop, done=lambda: ended.append(False))
    stopped.join_background()
    assert ended == [True, False] and not stopped.compiled and not stopped.compiling_unused
    stopped.run(program, jnp.asarray(x))  # what was not compiled compiles on first use, counted as waited on
    assert stopped.compiled_on_use == 1
