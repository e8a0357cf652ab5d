"""Write Params as a HF-layout checkpoint (config.json, model.safetensors, tokenizer, generation config).

The inverse of `zipage_jax.models.weights.load_hf_weights`: each weight under its declared HF name
(`models.params.WEIGHTS`), matrices as [out, in].
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from zipage_jax.models.params import WEIGHTS, Params
from zipage_jax.tasks.tokenizer import IM_END_ID, PAD_ID, save_tokenizer

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def hf_state_dict(params: Params, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """HF-named numpy tensors of a Qwen3 `params` (no attention biases), cast to `dtype`."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if params.layers.q_bias is not None:
        raise ValueError("params: attention biases are not part of the qwen3 layout")
    np_dtype = _DTYPES[dtype]

    def host(x, transpose):
        x = np.asarray(x, dtype=np.float32)
        return np.ascontiguousarray(np.swapaxes(x, -1, -2) if transpose else x).astype(np_dtype)

    tensors = {}
    for name, weight in WEIGHTS.items():
        value = params
        for part in name.split("."):
            value = getattr(value, part)
        if value is None:
            continue
        value = host(value, weight.transpose)
        if weight.per_layer:
            for i, layer in enumerate(value):
                tensors[weight.hf_name.format(layer=i)] = np.ascontiguousarray(layer)
        else:
            tensors[weight.hf_name] = value
    return tensors


def qwen3_hf_config(arch: dict, dtype: str = "bfloat16") -> dict:
    """A complete transformers Qwen3 config dict for architecture `arch` and the task tokenizer."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        **arch,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=PAD_ID,
    )
    out = config.to_dict()
    out["architectures"] = ["Qwen3ForCausalLM"]
    out["dtype"] = dtype
    return out


def save_hf_checkpoint(params: Params, arch: dict, directory, dtype: str = "bfloat16") -> None:
    """Write the full HF checkpoint of the tiny model into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(params, dtype), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(qwen3_hf_config(arch, dtype), indent=2) + "\n")
    generation = {"eos_token_id": IM_END_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(directory)
