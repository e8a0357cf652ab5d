"""What a compiled step does, read off its optimized HLO text: copies of the KV pool, host-synchronizing ops,
cross-device collectives."""

import re

import jax.numpy as jnp


def pool_copies(hlo_text: str, pool_shape: tuple, dtype) -> dict:
    """What the compiled step does with the KV pool (copies are the bad ones) and its host-synchronizing ops.

    Lists the opcodes of the optimized-HLO instructions whose result has the KV pool's shape.
    A fusion is named by the root opcode of its fused computation, e.g. ``fusion[dynamic-update-slice]``
    (an in-place update) vs ``fusion[copy]``.
    """
    type_name = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[jnp.dtype(dtype).name]
    shape = f"{type_name}[{','.join(map(str, pool_shape))}]"
    instruction = re.compile(r"=\s*" + re.escape(shape) + r"(?:\{[^}]*\})?\s+([\w-]+)\(")
    roots, computation = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$", line)
        if header:
            computation = header.group(1)
        root = re.search(r"ROOT\s+%?[\w.-]+\s*=\s*\S+(?:\{[^}]*\})?\s+([\w-]+)\(", line)
        if root and computation:
            roots[computation] = root.group(1)
    ops = {}
    for line in hlo_text.splitlines():
        m = instruction.search(line)
        if not m:
            continue
        op = m.group(1)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.-]+)", line)
            op = f"fusion[{roots.get(called.group(1), '?') if called else '?'}]"
        ops[op] = ops.get(op, 0) + 1
    count = lambda op: len(re.findall(r"\s" + op + r"\(", hlo_text))  # noqa: E731
    return dict(pool_shape=shape, ops_producing_pool_shape=ops,
                pool_copies=sum(n for op, n in ops.items() if "copy" in op),
                all_copy_ops=count("copy") + count("copy-start"),
                # on GPU each conditional (and a while loop without a known trip count) reads its predicate
                # back to the host, so the dispatching thread waits for the device there
                conditionals=count("conditional"), while_loops=count("while"),
                while_loops_with_known_trip_count=len(re.findall(r"known_trip_count", hlo_text)))


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter",
               "collective-broadcast")
_COLLECTIVE = re.compile(r"(?<![%\w.-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> dict:
    """How many of each cross-device collective a compiled program holds (an asynchronous ``-start`` / ``-done``
    pair counts once). Under tensor parallelism a step should hold two all-reduces a layer and nothing else."""
    found = {}
    for op in _COLLECTIVE.findall(hlo_text):
        found[op] = found.get(op, 0) + 1
    return found
