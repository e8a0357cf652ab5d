"""Start-up cost of the weights: reading a HF safetensors checkpoint (what the engine does) against restoring an
orbax checkpoint of the converted Params (``weights.save_params``: zstd, OCDBT; and uncompressed zarr2), side by
side in one process, alternating.

    python scripts/make_random_checkpoint.py /tmp/rand --model-shape qwen3-0.6b --num-layers 8
    python scripts/bench_weight_loading.py /tmp/rand --trials 5

Each timing ends when every array is on the device (``block_until_ready``). Every reader finds its files in the
OS page cache after the first trial, so these are warm-cache figures: the decoding, stacking, transposing and
casting a converted checkpoint would save, not the disk.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zipage_jax.models import weights
from zipage_jax.models.config import ModelConfig


def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def save_uncompressed(params, directory):
    with ocp.PyTreeCheckpointer(use_ocdbt=False, use_compression=False) as checkpointer:
        checkpointer.save(directory, params)


def restore_uncompressed(directory, abstract):
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype), abstract)
    with ocp.PyTreeCheckpointer(use_ocdbt=False, use_compression=False) as checkpointer:
        return checkpointer.restore(directory, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    cfg, dtype = ModelConfig.from_pretrained(args.model), jnp.dtype(args.dtype)
    params = weights.load_hf_weights(args.model, cfg, dtype)
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    with tempfile.TemporaryDirectory() as tmp:
        zstd, raw = Path(tmp) / "zstd", Path(tmp) / "raw"
        weights.save_params(params, zstd)
        save_uncompressed(params, raw)
        del params
        readers = {"safetensors": lambda: weights.load_hf_weights(args.model, cfg, dtype),
                   "orbax_zstd": lambda: weights.restore_params(zstd, cfg),
                   "orbax_raw": lambda: restore_uncompressed(raw, abstract)}
        times = {name: [] for name in readers}
        for _ in range(args.trials):
            for name, read in readers.items():
                times[name].append(timed(read))
    print(f"{args.model}: {size / 2**20:.0f} MiB of {dtype.name} params on {jax.devices()[0].device_kind}")
    base = statistics.median(times["safetensors"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:12} median {median:.3f}s ({median / base:.2f}x safetensors) over {args.trials} trials: "
              + ", ".join(f"{t:.3f}" for t in seconds))


if __name__ == "__main__":
    main()
