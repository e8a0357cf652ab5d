"""The share of the accelerator the engine fills, as vLLM users expect: ``gpu_memory_utilization`` of the card
holds the weights, the KV pool and the step scratch together.

jax's GPU allocator takes a fixed fraction of the card when its backend starts (75 % by default, or what
``XLA_CLIENT_MEM_FRACTION`` / its older name ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says) and never holds more;
``device.memory_stats()`` reports that fraction of the card as ``bytes_limit`` and what is allocated as
``bytes_in_use`` (it does not report the card itself). So the engine starts the backend itself, with the fraction
set to ``gpu_memory_utilization`` (``start_backend``), unless the user set a fraction (theirs wins) or the backend
already runs (a notebook that used jax first); ``read`` then says how much of the card the memory plan may fill.
"""

import contextlib
import dataclasses
import logging
import math
import os

import jax
from jax._src import xla_bridge  # backends_are_initialized: jax has no public way to ask

log = logging.getLogger(__name__)

FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jax reads either, not both
JAX_DEFAULT_FRACTION = 0.75
HEADROOM_BYTES = 2 * 2**30  # left inside the engine's share for what the scratch estimates do not count (XLA's
                            # GEMM autotuning while programs compile, library workspaces)


@dataclasses.dataclass(frozen=True)
class Allocator:
    """The fraction of each card jax's allocator may hold, and who chose it."""

    fraction: float
    source: str  # e.g. "set to gpu_memory_utilization=0.9", "XLA_CLIENT_MEM_FRACTION=0.5", "jax's default"
    user_set: bool = False  # the user's own environment variable chose it


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device reports, and the engine's share of it (bytes)."""

    card_bytes: int  # the card's memory: the allocator's limit over its fraction
    limit_bytes: int  # what the allocator may hold
    in_use_bytes: int  # allocated now (the weights, when the plan reads it)
    held_bytes: int  # held beside the weights by others (a notebook's arrays, a second copy), left out of the plan
    share_bytes: int  # what the engine may fill: gpu_memory_utilization of the card, within the allocator's limit
    allocator: Allocator

    @property
    def taken_bytes(self) -> int:
        """What the pool cannot have: the weights and what others hold beside them."""
        return self.in_use_bytes + self.held_bytes


_started: Allocator | None = None  # how this process's backend started, once an engine started it


def _user_setting() -> Allocator | None:
    for name in FRACTION_VARIABLES:
        value = os.environ.get(name)
        if value:
            try:
                return Allocator(float(value), f"{name}={value}", user_set=True)
            except ValueError:
                raise ValueError(f"gpu_memory_utilization: {name}={value!r} is set, and the engine can plan only "
                                 f"within a plain fraction of the card (unset it to use gpu_memory_utilization)")
    return None


def current() -> Allocator:
    """How the running backend's allocator was set up (as far as this process can tell)."""
    return _started or _user_setting() or Allocator(JAX_DEFAULT_FRACTION, "jax's default")


@contextlib.contextmanager
def start_backend(utilization: float):
    """Set the allocator up for ``utilization`` of each card, for the backend started inside the block (the
    engine joins its processes there and queries the devices); yields the ``Allocator`` it started with.

    The variable is set only for the block, so child processes see the user's environment, not the engine's.
    """
    global _started
    if xla_bridge.backends_are_initialized():
        if _started is None:
            _started = _user_setting() or Allocator(JAX_DEFAULT_FRACTION, "jax's default: its backend started "
                                                                          "before the engine")
        yield _started
        return
    setup = _user_setting()
    name = FRACTION_VARIABLES[0]
    if setup is None:
        setup = Allocator(utilization, f"set to gpu_memory_utilization={utilization}")
        os.environ[name] = repr(float(utilization))
    try:
        yield setup
        jax.devices()  # the backend starts here, if the block did not start it
    finally:
        if not setup.user_set:
            del os.environ[name]
        if xla_bridge.backends_are_initialized():
            _started = setup if setup.user_set else Allocator(
                utilization, f"set by an earlier engine to its gpu_memory_utilization={utilization}")


def read(device, utilization: float, allocator: Allocator | None = None,
         weights_bytes: int | None = None) -> DeviceMemory | None:
    """The device's memory and the engine's share of it; None where the device reports no limit (CPU).

    The share is ``utilization`` of the card, capped by what the allocator may hold: a user's smaller fraction
    is logged, a smaller one that the engine could not set (the backend started first) is warned about.
    ``weights_bytes``: what the engine's weights take on this device, counted from its arrays; the plan then
    reads it instead of the allocator's ``bytes_in_use``, which moves by tens of MB from one start to the next, so
    the pool, and with it every program's shapes (the executable store's keys), is the same at every start. What
    else is in use beyond half the headroom (arrays a notebook or a benchmark holds) is ``held_bytes``, counted in
    whole GiB for the same reason: the plan leaves it out rather than place a pool that cannot fit.
    """
    stats = device.memory_stats()
    if not stats or not stats.get("bytes_limit"):
        return None
    allocator = allocator or current()
    limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    held = 0
    if weights_bytes is not None:
        if in_use > weights_bytes + HEADROOM_BYTES // 2:
            held = math.ceil((in_use - weights_bytes) / 2**30) * 2**30
            log.warning("%.2f GiB are in use on %s beside the engine's %.2f GiB of weights: the plan leaves %d GiB "
                        "out of the engine's share", (in_use - weights_bytes) / 2**30, device, weights_bytes / 2**30,
                        held // 2**30)
        in_use = weights_bytes
    card = int(round(limit / allocator.fraction))
    if utilization > allocator.fraction + 1e-6:
        message = ("jax's allocator holds %.0f%% of the %.1f GiB card (%s), less than gpu_memory_utilization=%s: "
                   "the engine plans within it")
        args = (100 * allocator.fraction, card / 2**30, allocator.source, utilization)
        if allocator.user_set:
            log.info(message, *args)
        else:
            log.warning(message + "; jax sets its allocator up once, when its backend starts: create the engine "
                        "before anything else uses jax, or set %s", *args, FRACTION_VARIABLES[0])
    share = limit if utilization >= allocator.fraction else int(utilization * card)
    return DeviceMemory(card_bytes=card, limit_bytes=limit, in_use_bytes=in_use, held_bytes=held,
                        share_bytes=share, allocator=allocator)


def check_allocated(device, in_use_before: int | None, expected_bytes: int, what: str) -> int | None:
    """Warn when allocating ``expected_bytes`` (``what``) moved the device's ``bytes_in_use`` by much less: two
    arrays then share one buffer, and the first program that donates both allocates the missing one, after the
    plan's headroom is spent. Returns the allocator's growth (None where the device reports none: CPU)."""
    stats = device.memory_stats()
    if in_use_before is None or not stats or "bytes_in_use" not in stats:
        return None
    grown = int(stats["bytes_in_use"]) - in_use_before
    if grown < 0.9 * expected_bytes:
        log.warning("%s: %.2f GiB allocated on %s where %.2f GiB were expected; the first step will allocate the "
                    "rest", what, grown / 2**30, device, expected_bytes / 2**30)
    return grown


def bytes_on(device, tree) -> int:
    """Bytes the arrays of ``tree`` hold on ``device`` (their shards there)."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
               if shard.device == device)


def in_use(device) -> int | None:
    """The allocator's ``bytes_in_use`` on ``device``; None where the device reports none (CPU)."""
    stats = device.memory_stats()
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
