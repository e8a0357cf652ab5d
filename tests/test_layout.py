"""The package's layering (docs/ARCHITECTURE.md, Layers), read off the source with ``ast``: every import of a
``zipage_jax`` module, at module level or inside a function, points to the same layer or one below, and no two
modules import each other through any chain. ``serve --help`` answers without loading jax."""

import ast
import pathlib
import subprocess
import sys

import pytest

from waiting import HANG_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zipage_jax"

# lowest first; a module may import from its own layer or any below
LAYERS = (
    ("config", "sampling_params", "structured_output"),  # settings; grammars on the host (plain Python)
    ("parallel", "core"),                       # the device mesh; host bookkeeping (no jax)
    ("models", "compression"),                  # device math
    ("layers",),                                # the kernel interface and sampling, shared by models and worker
    ("worker",),                                # compiled steps over the donated device state
    ("engine", "tasks"),                        # the step loop, LLM, the async engine; the shipped tasks
    ("entrypoints",),                           # server, eval
    ("benchmarks",),
    ("serve", "eval", "bench", "cli", "__init__"),  # `python -m` entry points, `zipage-jax`, the package
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def top(module: str) -> str:
    """``zipage_jax.worker.kv_cache`` -> ``worker``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(module: str) -> set[str]:
    """The zipage_jax modules ``module`` imports (a name imported from a package counts as the package, unless
    the name is itself a module)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "zipage_jax")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "zipage_jax":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: relative import; the layer test reads absolute ones")
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_top_level_name_has_a_layer():
    assert {top(m) for m in MODULES} - {"assets"} <= set(RANK), "add new packages to LAYERS (and ARCHITECTURE.md)"


def test_no_module_imports_from_a_layer_above():
    upward = [f"{m} ({top(m)}) -> {d} ({top(d)})" for m, deps in GRAPH.items() for d in deps
              if RANK[top(d)] > RANK[top(m)]]
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_no_import_cycles():
    """Tarjan's strongly connected components over the module graph: every component is one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layer_test_sees_imports():
    """The graph is not vacuous: known edges are there (a parser that missed imports would pass the tests above)."""
    assert "zipage_jax.worker.worker" in GRAPH["zipage_jax.engine.llm_engine"]
    assert "zipage_jax.config" in GRAPH["zipage_jax.compression.scoring"]
    assert "zipage_jax.engine.llm_engine" in GRAPH["zipage_jax.entrypoints.api_server"]  # a late import counts


def test_pallas_kernels_never_import_the_engine():
    for path in (ROOT / "pallas_kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("zipage_jax"), path
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("zipage_jax") for a in node.names), path


@pytest.mark.parametrize("entry", ["zipage_jax.serve", "zipage_jax.eval"])
def test_help_does_not_load_jax(entry):
    code = ("import runpy, sys\n"
            f"sys.argv = ['{entry}', '--help']\n"
            "try:\n"
            f"    runpy.run_module('{entry}', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('LOADED' if 'jax' in sys.modules else 'NOT LOADED', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert "--help" in proc.stdout or "usage" in proc.stdout, proc.stderr
    assert proc.stderr.strip().endswith("NOT LOADED"), proc.stderr


def test_public_names_load_lazily():
    code = ("import sys, zipage_jax\n"
            "before = 'jax' in sys.modules\n"
            "from zipage_jax import LLM, SamplingParams, EngineConfig, LLMEngine, RequestOutput, CompletionOutput\n"
            "print(before, 'jax' in sys.modules, LLM.__module__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert proc.stdout.split() == ["False", "True", "zipage_jax.engine.llm"], proc.stderr


# -- benchmarks drive the engine through its public seams -------------------------------------------------------
ENGINE_ROOTS = {"engine", "llm", "scheduler", "worker", "runner", "page_manager", "request"}  # hold engine objects
ENGINE_MAKERS = {"LLMEngine", "LLM", "Request", "Scheduler", "Worker", "ModelRunner", "make_engine"}
MUTATORS = {"append", "appendleft", "extend", "insert", "remove", "pop", "popleft", "clear", "update", "add",
            "discard", "setdefault", "sort", "reverse", "__setitem__", "__delitem__"}


def _root(node):
    """The name an attribute / item / call chain starts from (``engine`` in ``engine.scheduler.running[0]``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _has_attribute(node) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return False


def _bindings(tree):
    """(target, value) of every binding in the module: assignments, loops, comprehensions, with, walrus."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            yield from ((t, node.value) for t in node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            yield node.target, node.value
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield node.target, node.iter
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield node.optional_vars, node.context_expr


def _bound_names(target):
    """The names a binding target binds (``a, (b, *c)``; not ``x`` of ``x.y = ...`` or ``x[0] = ...``)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _bound_names(element)
    elif isinstance(target, ast.Starred):
        yield from _bound_names(target.value)


def engine_mutations(source: str) -> list[str]:
    """Where ``source`` changes an engine's state other than through a method call: an assignment to (or ``del``,
    ``setattr`` of) an attribute or item of an object reached from an engine, a mutating method of a collection
    held by one (``engine.scheduler.running.append``), or any touch of a private attribute (``runner._dispatch``).
    An object is reached from an engine when its name is bound, anywhere in the module and through any chain of
    bindings, to an expression that mentions one of ``ENGINE_ROOTS`` or calls one of ``ENGINE_MAKERS``."""
    tree = ast.parse(source)
    reached, aliases = set(ENGINE_ROOTS), set()
    grew = True
    while grew:
        grew = False
        for target, value in _bindings(tree):
            names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
            makers = {_root(n.func) for n in ast.walk(value) if isinstance(n, ast.Call)} & ENGINE_MAKERS
            if names & reached or makers:
                for name in _bound_names(target):
                    grew |= name not in reached
                    reached.add(name)
                    if isinstance(value, (ast.Attribute, ast.Subscript)) and _root(value) in reached:
                        # an engine's own object (not what a method returned)
                        aliases.add(name)

    def internal(node) -> bool:
        return _root(node) in reached and (_has_attribute(node) or _root(node) in aliases)

    found = []
    for node in ast.walk(tree):
        line = f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]}"
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, (ast.Store, ast.Del)) \
                        and _root(t) in reached and (isinstance(t, ast.Attribute) or internal(t.value)):
                    found.append(line)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args \
                    and _root(node.args[0]) in reached:
                found.append(line)
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS and internal(func.value):
                found.append(line)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and _root(node) in reached:
            found.append(line)
    return found


def test_benchmarks_never_change_engine_state_but_through_its_methods():
    """The benchmarks hold, release, drain, observe and replay through public hooks (docs/ARCHITECTURE.md, Engine
    step); none assigns to, deletes or monkeypatches what an engine holds."""
    found = {path.name: engine_mutations(path.read_text()) for path in sorted((PACKAGE / "benchmarks").glob("*.py"))}
    assert not any(found.values()), {name: lines for name, lines in found.items() if lines}


def test_the_mutation_check_finds_mutations():
    """What the benchmarks did before they had hooks, each found; and the hooks themselves pass."""
    bad = """
def bench(engine, make_engine):
    engine.scheduler.running = []
    runner = engine.runner
    runner.execute = print
    setattr(engine, "history", None)
    requests = [Request(f"r{i}", [1], None, i) for i in range(2)]
    for r in requests:
        r.num_computed_tokens = 3
        del r.output_token_ids[1:]
    engine.scheduler.running.append(requests[0])
    engine.runner.programs.run = print
    step = engine.runner._dispatch
    running = engine.scheduler.running
    running.clear()
    other = make_engine("full")
    other.history.samples[0] = None
"""
    assert len(engine_mutations(bad)) == 10, engine_mutations(bad)
    good = """
def bench(engine, worker):
    engine.scheduler.hold([engine.requests["a"]])
    outputs = engine.drain(only_finished=True)
    outputs.append(None)
    seen = []
    engine.add_step_observer(seen.append)
    engine.add_compression_observer(CompressionTimer())
    row = dict(running=engine.metrics()["num_running"])
    row["tokens"] = [r.output_token_ids for r in engine.requests.values()]
    replay = DecodeReplay(worker)
    replay()
"""
    assert engine_mutations(good) == []


def test_nothing_reaches_into_the_engines_device_side():
    """The step loop alone talks to the worker: elsewhere in the package no ``engine.worker`` (or the old
    ``engine.runner``) chain, but in the benchmarks' probes (``DecodeReplay.of``); a benchmark that needs more of
    the device side builds its worker and holds it."""
    import re

    reach = re.compile(r"\bengine\.(worker|runner)\b")
    allowed = {PACKAGE / "engine" / "llm_engine.py", PACKAGE / "benchmarks" / "probes.py"}
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted(PACKAGE.rglob("*.py")) if path not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert not found, found


MAX_MODULE_LINES, MAX_CLASS_LINES = 450, 300


def test_modules_and_classes_stay_short_enough_to_read():
    """No module of the package over 450 lines, no class over 300 (split along what they do)."""
    long_modules, long_classes = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long_modules and not long_classes, (long_modules, long_classes)


def _engine_group_actions(parser) -> set:
    return {a for g in parser._action_groups if g.title.startswith("engine (") for a in g._group_actions}


def test_benchmark_command_lines_take_the_engine_options_by_their_own_names():
    """Every benchmark that builds an engine takes its options from ``add_engine_options`` (``--page-size``,
    ``--max-num-batched-tokens``, ...), never declares one by hand nor under another name."""
    import argparse

    from zipage_jax.benchmarks import cli, sweep
    from zipage_jax.config import option_fields

    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in subparsers.choices.items() if name not in cli.OWN_COMMAND_LINE}
    parsers["sweep"] = sweep.build_parser()[0]
    del parsers["serving"]  # a client of a running server: its --page-size and --max-model-len shape the workload
    fields = set(option_fields())
    renamed = {"prefill_tokens", "prefill_seqs", "num_pages", "kv_cache_gb"}  # what they were called before
    for name, parser in parsers.items():
        engine = _engine_group_actions(parser)
        assert engine, name
        for action in parser._actions:
            assert action in engine or (action.dest not in fields and action.dest not in renamed), (name, action.dest)
