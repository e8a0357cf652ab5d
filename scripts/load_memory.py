"""Peak device memory per device while the engine's weights load: whole on one device then sharded
(``weights.shard_params(weights.load_hf_weights(...))``, the path before ``load_sharded``) against straight into
the shards (``weights.load_sharded``, what the engine does), per tensor-parallel size.

    python scripts/make_random_checkpoint.py /tmp/qwen3-0.6b --model-shape qwen3-0.6b
    PYTHONPATH=. python scripts/load_memory.py /tmp/qwen3-0.6b --tensor-parallel-size 1 2 4 --cpu-devices 4

Each (path, size) loads in a fresh process (run from the repo root with ``PYTHONPATH=.`` to measure this checkout).
On a GPU the figure is the allocator's ``peak_bytes_in_use`` of each device. CPU devices keep no such count:
``--cpu-devices N`` simulates N devices, and the peak is then that of the bytes held by live jax arrays on each
device, sampled at every line of zipage_jax code a second, traced load runs (XLA's temporaries inside one jitted
call are not seen); the load time is the first, untraced load's.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import jax

PATHS = ("whole_then_shard", "sharded")


class LiveArrayPeak:
    """The most bytes of live jax arrays each device held at any line of zipage_jax code run while tracing."""

    def __init__(self, devices):
        self.peak = dict.fromkeys(devices, 0)

    def sample(self):
        held = dict.fromkeys(self.peak, 0)
        for array in jax.live_arrays():
            size = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
            for device in array.sharding.device_set:
                held[device] += size
        for device, size in held.items():
            self.peak[device] = max(self.peak[device], size)

    def _call(self, frame, event, arg):
        if f"{os.sep}zipage_jax{os.sep}" in frame.f_code.co_filename:
            self.sample()
            return self._line
        return None

    def _line(self, frame, event, arg):
        if event in ("line", "return"):
            self.sample()
        return self._line

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        self.sample()


def measure(model: str, path: str, size: int, dtype: str) -> dict:
    """Load once in this process; the per-device peak and what stays held."""
    import jax.numpy as jnp

    from zipage_jax import parallel
    from zipage_jax.models import weights
    from zipage_jax.models.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    mesh = parallel.make_mesh(size, cfg)
    devices = list(mesh.devices.flat)
    on_gpu = devices[0].platform == "gpu"

    def load():
        if path == "sharded":
            return jax.block_until_ready(weights.load_sharded(model, cfg, jnp.dtype(dtype), mesh))
        return jax.block_until_ready(weights.shard_params(weights.load_hf_weights(model, cfg, jnp.dtype(dtype)),
                                                           mesh))

    start = time.perf_counter()
    params = load()
    seconds = time.perf_counter() - start
    sampler = None
    if not on_gpu:  # again, traced (the sampling slows it down): the first load's arrays are gone by then
        del params
        sampler = LiveArrayPeak(devices)
        with sampler:
            params = load()
    if on_gpu:
        stats = [d.memory_stats() for d in devices]
        peak, held = [s["peak_bytes_in_use"] for s in stats], [s["bytes_in_use"] for s in stats]
    else:
        peak = [sampler.peak[d] for d in devices]
        sampler.peak = dict.fromkeys(devices, 0)
        sampler.sample()
        held = [sampler.peak[d] for d in devices]
    return dict(path=path, tensor_parallel_size=size, peak_bytes=peak, held_bytes=held, load_s=seconds,
                device_kind=devices[0].device_kind, measured="allocator peak" if on_gpu else "live jax arrays",
                param_bytes=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint directory")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cpu-devices", type=int, help="simulate this many CPU devices (no GPU)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--case", nargs=2, metavar=("PATH", "SIZE"), help=argparse.SUPPRESS)  # one child run
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.model, args.case[0], int(args.case[1]), args.dtype)))
        return
    env = dict(os.environ)
    if args.cpu_devices:
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}")
    results = []
    print(f"{'tp':>3} {'path':>17} {'params MiB':>10} {'load s':>7}  peak MiB per device  (held after load)")
    for size in args.tensor_parallel_size:
        for path in args.paths:
            child = subprocess.run([sys.executable, __file__, args.model, "--dtype", args.dtype, "--case", path,
                                    str(size)], env=env, capture_output=True, text=True)
            if child.returncode:
                print(f"{size:>3} {path:>17} failed: {child.stderr.strip().splitlines()[-1:]}")
                results.append(dict(path=path, tensor_parallel_size=size, error=child.stderr[-2000:]))
                continue
            r = json.loads(child.stdout.strip().splitlines()[-1])
            results.append(r)
            mib = lambda values: ", ".join(f"{v / 2**20:.0f}" for v in values)  # noqa: E731
            print(f"{size:>3} {path:>17} {r['param_bytes'] / 2**20:>10.0f} {r['load_s']:>7.1f}  "
                  f"[{mib(r['peak_bytes'])}]  ([{mib(r['held_bytes'])}])  {r['device_kind']}, {r['measured']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, dtype=args.dtype, results=results), f, indent=1)


if __name__ == "__main__":
    main()
