"""Model weights: HF safetensors -> Params, or straight into the engine's sharded ServingParams; orbax
save/restore of converted Params, random init; each read off the weight declarations (``params.WEIGHTS``).

The engine reads safetensors at every start (``load_sharded``): restoring an orbax checkpoint of the converted
Params was slower (docs/lab-notes/startup.md), so there is no weights cache.

``load_hf_weights`` streams one stacked field at a time (host buffer -> device -> released) so peak host memory
is one field, never two copies of the model. ``load_sharded`` sends each device only the slices it keeps.
"""

from __future__ import annotations

import concurrent.futures
import math
import functools
import os
import json
import mmap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zipage_jax.models.config import ModelConfig
from zipage_jax.models.params import (
    SERVING_LAYER_PARTS,
    WEIGHTS,
    Params,
    ServingLayer,
    ServingParams,
    Weight,
    model_weights,
    param_shapes,
    param_shardings,
    params_from_flat,
    serving_layer,
    to_serving,
)

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}

LOAD_THREADS = min(16, os.cpu_count() or 1)  # leaves read and copied to the devices at once

# Tensors some checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsFile:
    """Zero-copy numpy views of the tensors in one .safetensors file (bf16 through ml_dtypes)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header_len = int.from_bytes(self._map[:8], "little")
        header = json.loads(self._map[8 : 8 + header_len])
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries = header

    def get(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} in {self.path} has unsupported dtype {entry['dtype']}")
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin)
        return array.reshape(entry["shape"])


class SafetensorsCheckpoint:
    """All tensors of a HF checkpoint directory: one model.safetensors or shards named by the index."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"path: checkpoint directory {self.path} does not exist")
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.path / shard for name, shard in weight_map.items()}
        elif single.exists():
            files = None
        else:
            raise ValueError(f"path: {self.path} has neither model.safetensors nor model.safetensors.index.json")
        self._open: dict[Path, SafetensorsFile] = {}
        if files is None:
            shard = self._file(single)
            files = {name: single for name in shard.entries}
        self.files = files

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            if not path.exists():
                raise ValueError(f"path: shard {path} named by the index does not exist")
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"checkpoint {self.path} lacks tensor {name!r}")
        return self._file(self.files[name]).get(name)


@jax.jit
def _transpose_last(x):
    return jnp.swapaxes(x, -1, -2)


def _load_field(ckpt: SafetensorsCheckpoint, names: list[str], transpose: bool, shape, dtype, device):
    """Stack tensors `names` into one host buffer (HF layout), send it to the device, convert there."""
    first = ckpt.get(names[0])
    stacked_shape = (len(names), *first.shape) if len(shape) > first.ndim else first.shape
    expected = tuple(stacked_shape[:-2]) + tuple(stacked_shape[:-3:-1]) if transpose else tuple(stacked_shape)
    if expected != tuple(shape):
        raise ValueError(
            f"tensor {names[0]!r} has shape {first.shape}, which does not fit the config (field shape {shape})"
        )
    if stacked_shape == first.shape:
        host = first  # a single tensor: send the memory-mapped view as is
    else:
        host = np.empty(stacked_shape, dtype=first.dtype)
        for i, name in enumerate(names):
            tensor = ckpt.get(name)
            if tensor.shape != first.shape:
                raise ValueError(f"tensor {name!r} has shape {tensor.shape}, expected {first.shape}")
            host[i] = tensor
    array = jax.device_put(host, device).block_until_ready()  # the host buffer is free before the next field
    del host
    if transpose:
        array = _transpose_last(array)
    return array.astype(dtype)


def load_hf_weights(path, cfg: ModelConfig, dtype=jnp.bfloat16, device=None) -> Params:
    """Params from the safetensors of a HF checkpoint directory, cast to `dtype`, on `device` (default device)."""
    ckpt = SafetensorsCheckpoint(path)
    device = device or jax.devices()[0]
    shapes = param_shapes(cfg)
    used: set[str] = set()
    flat = {}
    for name, weight in model_weights(cfg).items():
        names = weight.hf_names(cfg.num_layers)
        flat[name] = _load_field(ckpt, names, weight.transpose, shapes[name], dtype, device)
        used.update(names)
    _check_all_used(ckpt, used, cfg)
    return params_from_flat(flat)


def _check_all_used(ckpt: SafetensorsCheckpoint, used: set[str], cfg: ModelConfig):
    unused = {
        n for n in ckpt.names() - used
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    }
    if unused:
        raise ValueError(f"checkpoint {ckpt.path} has tensors the {cfg.model_type} config does not use: "
                         f"{sorted(unused)[:8]}")


def load_sharded(path, cfg: ModelConfig, dtype, mesh) -> ServingParams:
    """The engine's weights: ``shard_params(load_hf_weights(path, cfg, dtype), mesh)``, without a full
    copy on one device.

    Each weight is made by ``jax.make_array_from_callback`` in the checkpoint's layout and dtype, sharded as its
    target transposed: every device receives only the slice it keeps, read from the memory-mapped file (the
    fused q/k/v and gate/up columns of its own shard, assembled on the host), then transposes and casts it in
    place. Replicated weights (embedding, LM head, norms) reach every device whole. With several processes each
    one fills its own devices' shards.
    """
    ckpt = SafetensorsCheckpoint(path)
    abstract, targets = _serving_targets(cfg, dtype, mesh)
    used: set[str] = set()

    def load(weights: list[Weight], target, sharding, layer: int | None = None):
        """The leaf ``target`` from the HF tensors of ``weights`` (several: the parts of a fused buffer)."""
        transpose = weights[0].transpose  # the same for every part of a fused buffer
        names = [w.hf_name.format(layer=layer) for w in weights]
        hf_shapes = [w.shape(cfg)[::-1] if transpose else w.shape(cfg) for w in weights]
        used.update(names)
        return _load_sharded_field(ckpt, names, hf_shapes, transpose, target, sharding, mesh.size)

    # Every leaf is read (memory-mapped), assembled (fused columns) and copied to its devices on a thread pool:
    # reading one leaf overlaps the host->device copies of others (numpy and the copies release the GIL).
    # The embedding and the LM head go first: the engine allocates its KV pool before loading, and their
    # transposes (XLA autotunes each new shape, with outputs the size of the table) need the room that the
    # layers' weights take later.
    jobs = {}
    for name in (n for n in WEIGHTS if not n.startswith("layers.")):
        target = getattr(abstract, name)
        if target is not None:
            jobs[name] = ([WEIGHTS[name]], target, getattr(targets, name), None)
    for i, (layer, sharding) in enumerate(zip(abstract.layers, targets.layers)):
        for field, parts in SERVING_LAYER_PARTS.items():
            target = getattr(layer, field)
            if target is not None:
                jobs[(i, field)] = ([WEIGHTS[f"layers.{p}"] for p in parts], target, getattr(sharding, field), i)
    with concurrent.futures.ThreadPoolExecutor(LOAD_THREADS) as pool:
        loaded = dict(zip(jobs, pool.map(lambda job: load(*job), jobs.values())))
    layers = [ServingLayer(**{field: loaded.get((i, field)) for field in SERVING_LAYER_PARTS})
              for i in range(len(abstract.layers))]
    top = {name: loaded.get(name) for name in WEIGHTS if not name.startswith("layers.")}
    _check_all_used(ckpt, used, cfg)
    return ServingParams(layers=tuple(layers), shards=mesh.size, **top)


@functools.cache  # the engine plans with it before loading, then loads with it
def _serving_targets(cfg: ModelConfig, dtype, mesh) -> tuple[ServingParams, ServingParams]:
    """The serving layout's shapes (``jax.ShapeDtypeStruct`` leaves) and their shardings."""
    shapes = param_shapes(cfg)
    stacked = params_from_flat({f: None if s is None else jax.ShapeDtypeStruct(s, dtype) for f, s in shapes.items()})
    abstract = jax.eval_shape(lambda p: to_serving(p, mesh.size), stacked)
    return abstract, param_shardings(abstract, mesh)


def device_bytes(cfg: ModelConfig, dtype, mesh, device) -> int:
    """What ``load_sharded`` will hold on ``device``, known before loading (the engine plans its memory and
    allocates the KV pool first, into an allocator that nothing has fragmented yet)."""
    abstract, targets = _serving_targets(cfg, dtype, mesh)
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(targets)):
        if device in sharding.device_set:
            total += math.prod(sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def _load_sharded_field(ckpt, names, hf_shapes, transpose: bool, target, sharding, shards: int):
    """One ServingParams leaf from the HF tensors ``names`` (fused along their first axis, grouped per shard)."""
    tensors = [ckpt.get(name) for name in names]
    for name, tensor, shape in zip(names, tensors, hf_shapes):
        if tensor.shape != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tensor.shape}, which does not fit the config "
                             f"(expected {tuple(shape)})")
    groups = shards if len(tensors) > 1 else 1
    hf_layout = target.shape[::-1] if transpose else target.shape
    source = sharding
    if transpose:
        spec = tuple(sharding.spec) + (None,) * (len(target.shape) - len(sharding.spec))
        source = NamedSharding(sharding.mesh, P(*spec[::-1]))

    def shard(index):
        return _fused_rows(tensors, groups, index[0])[(slice(None),) + tuple(index[1:])]

    array = jax.make_array_from_callback(hf_layout, source, shard, dtype=tensors[0].dtype)
    return _to_target(array, transpose, target.dtype, sharding)


def _fused_rows(tensors, groups: int, rows: slice) -> np.ndarray:
    """Rows ``rows`` of the tensors concatenated along axis 0 in ``groups`` interleaved groups
    ``[t0_g0 | t1_g0 | ... | t0_g1 | t1_g1 | ...]`` (``params.fuse_columns`` on the HF layout), read from the
    tensors' own rows: a memory-mapped view where one tensor covers them."""
    start, stop, _ = rows.indices(sum(t.shape[0] for t in tensors))
    pieces, offset = [], 0
    for g in range(groups):
        for t in tensors:
            width = t.shape[0] // groups
            lo, hi = max(start, offset), min(stop, offset + width)
            if lo < hi:
                pieces.append(t[g * width + lo - offset:g * width + hi - offset])
            offset += width
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _to_target(x, transpose: bool, dtype, sharding):
    """Transpose (a row shard becomes a column shard: no communication) and cast, shard by shard."""
    if not transpose and x.dtype == dtype:
        return x
    return _converter(transpose, jnp.dtype(dtype), sharding)(x)


@functools.cache
def _converter(transpose: bool, dtype, sharding):
    return jax.jit(lambda x: (jnp.swapaxes(x, -1, -2) if transpose else x).astype(dtype), out_shardings=sharding)


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Deterministic random Params (each weight's initializer: normal(std), norm scales 1 + normal(std)),
    generated on the device weight by weight."""
    shapes, present = param_shapes(cfg), model_weights(cfg)
    return params_from_flat({name: _random_weight(key, name, shapes[name], jnp.dtype(dtype), std)
                             for name in WEIGHTS if name in present})


def init_random_serving_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, shards: int = 1,
                               std: float = 0.02) -> ServingParams:
    """Deterministic random weights made straight in the serving layout, layer by layer (values of their own, not
    ``init_random_params``'s): the device holds the weights and one layer's noise at most, never a stacked copy
    beside the serving one, so an engine can make them after placing a pool sized for one copy."""
    top = _random_top(cfg, key, jnp.dtype(dtype), std)
    layers = tuple(_random_serving_layer(cfg, _layer_key(key, i), jnp.dtype(dtype), shards, std)
                   for i in range(cfg.num_layers))
    return ServingParams(embed=top["embed"], layers=layers, final_norm=top["final_norm"], lm_head=top.get("lm_head"),
                         shards=shards)


def init_random_serving_params_stacked(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16,
                                       std: float = 0.02) -> Params:
    """``init_random_serving_params``'s values in the stacked layout: an oracle's copy (``forward_dense``) of the
    weights an engine made for itself."""
    dtype = jnp.dtype(dtype)
    per_layer = [_random_layer(cfg, _layer_key(key, i), dtype, std) for i in range(cfg.num_layers)]
    layers = {name: jnp.concatenate([layer[name] for layer in per_layer]) for name in per_layer[0]}
    return params_from_flat({**_random_top(cfg, key, dtype, std), **layers})


def _random_top(cfg: ModelConfig, key, dtype, std: float) -> dict:
    shapes = param_shapes(cfg)
    return {name: _random_weight(key, name, shapes[name], dtype, std)
            for name in WEIGHTS if shapes[name] is not None and not name.startswith("layers.")}


def _layer_key(key, i: int):
    return jax.random.fold_in(key, len(WEIGHTS) + i)


def _random_layer(cfg: ModelConfig, key, dtype, std: float) -> dict:
    """One layer's random weights by flat name, each with a leading axis of 1."""
    shapes = param_shapes(cfg)
    return {name: _random_weight(key, name, (1,) + shapes[name][1:], dtype, std)
            for name in WEIGHTS if shapes[name] is not None and name.startswith("layers.")}


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _random_serving_layer(cfg: ModelConfig, key, dtype, shards: int, std: float) -> ServingLayer:
    stacked = params_from_flat({"embed": None, "final_norm": None, **_random_layer(cfg, key, dtype, std)}).layers
    return serving_layer(stacked, 0, shards)


def _random_weight(key, name: str, shape, dtype, std: float):
    """Weight ``name``'s random values: its own stream of ``key`` (by declaration order), its initializer."""
    return _random_field(jax.random.fold_in(key, list(WEIGHTS).index(name)), shape, dtype, std,
                         WEIGHTS[name].init == "ones")


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_field(key, shape, dtype, std, is_norm):
    noise = jax.random.normal(key, shape, jnp.float32) * std
    return (1.0 + noise if is_norm else noise).astype(dtype)


def save_params(params: Params, directory) -> None:
    """Write Params as an orbax checkpoint at `directory` (must not exist yet)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise ValueError(f"directory: {directory} already exists")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, params)


def restore_params(directory, cfg: ModelConfig, device=None) -> Params:
    """Read Params saved by `save_params`, checking every field's shape against `cfg`."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise ValueError(f"directory: orbax checkpoint {directory} does not exist")
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(directory).item_metadata.tree
        abstract = {}
        for field, shape in param_shapes(cfg).items():
            parts = field.split(".")
            meta = tree.get(parts[0]) if len(parts) == 1 else (tree.get(parts[0]) or {}).get(parts[1])
            if (meta is None) != (shape is None) or (meta is not None and tuple(meta.shape) != shape):
                found = None if meta is None else tuple(meta.shape)
                raise ValueError(f"checkpoint {directory}: field {field} is {found}, the config expects {shape}")
            if shape is not None:
                abstract[field] = jax.ShapeDtypeStruct(shape, meta.dtype, sharding=sharding)
        return checkpointer.restore(directory, params_from_flat(abstract))


def shard_params(params: Params | ServingParams, mesh: Mesh) -> ServingParams:
    """The engine's weights: ``params`` in the serving layout (fused per shard of ``mesh``), placed on it."""
    serving = params if isinstance(params, ServingParams) else to_serving(params, mesh.size)
    if serving.shards != mesh.size:
        raise ValueError(f"params: fused for {serving.shards} shards, the mesh has {mesh.size} devices")
    return jax.device_put(serving, param_shardings(serving, mesh))
