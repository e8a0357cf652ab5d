"""The package's layering (docs/ARCHITECTURE.md, Layers), read off the source with ``ast``: every import of a
``zipage_jax`` module, at module level or inside a function, points to the same layer or one below, and no two
modules import each other through any chain. ``serve --help`` answers without loading jax."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zipage_jax"

# lowest first; a module may import from its own layer or any below
LAYERS = (
    ("config", "sampling_params"),              # settings, plain Python
    ("parallel", "core"),                       # the device mesh; host bookkeeping (no jax)
    ("models", "compression"),                  # device math
    ("layers",),                                # the kernel interface and sampling, shared by models and worker
    ("worker",),                                # compiled steps over the donated device state
    ("engine", "tasks"),                        # the step loop, LLM, the async engine; the shipped tasks
    ("entrypoints",),                           # server, eval
    ("benchmarks",),
    ("serve", "eval", "bench", "__init__"),     # `python -m` entry points and the lazy package front
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
    assert "zipage_jax.worker.model_runner" in GRAPH["zipage_jax.engine.llm_engine"]
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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "--help" in proc.stdout or "usage" in proc.stdout, proc.stderr
    assert proc.stderr.strip().endswith("NOT LOADED"), proc.stderr


def test_public_names_load_lazily():
    code = ("import sys, zipage_jax\n"
            "before = 'jax' in sys.modules\n"
            "from zipage_jax import LLM, SamplingParams, EngineConfig, LLMEngine, RequestOutput, CompletionOutput\n"
            "print(before, 'jax' in sys.modules, LLM.__module__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.stdout.split() == ["False", "True", "zipage_jax.engine.llm"], proc.stderr
