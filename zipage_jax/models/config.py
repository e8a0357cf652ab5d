"""ModelConfig: the static description of a llama / qwen2 / qwen3 decoder, read from a HF config.

Frozen and hashable so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling parameters."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling must be None or Llama3RopeScaling, got {self.rope_scaling!r}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple of ints, got {self.eos_token_ids!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path) -> "ModelConfig":
        """Read `config.json` of a HF checkpoint directory (or Hub id).

        A config that states every field whose default differs between the HF classes is read as plain JSON:
        importing transformers imports torch where it is installed, seconds of a start that needs only a few
        numbers. Any other config goes through transformers.AutoConfig, which knows each class's defaults.
        """
        file = pathlib.Path(path).expanduser() / "config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        if _states_every_class_default(raw):
            return cls.from_hf_config(types.SimpleNamespace(**raw))
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(str(path)))

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelConfig":
        """Translate a transformers PretrainedConfig (4.x or 5.x key layout)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; only 'silu'")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        rope_theta, rope_scaling = _read_rope(hf_config)
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))
        eos = hf_config.eos_token_id
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hidden,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf_config.max_position_embeddings,
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
            dtype=str(dtype).removeprefix("torch."),
        )


# Read from JSON only when present: their defaults differ between the HF classes (Qwen2's 32 kv heads, Qwen3's
# head_dim of 128, Llama's bos of 1). The fields absent here default to the same value in every class.
_FIELDS_WITHOUT_COMMON_DEFAULT = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                  "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings")


def _states_every_class_default(raw: dict) -> bool:
    """Whether ``raw`` (a config.json) reads the same as plain JSON as through its transformers class."""
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES or any(k not in raw for k in _FIELDS_WITHOUT_COMMON_DEFAULT):
        return False
    if raw["model_type"] == "qwen3" and raw.get("head_dim") is None:
        return False
    rope = raw.get("rope_parameters") or {}
    return "rope_theta" in raw or (isinstance(rope, dict) and "rope_theta" in rope)


def _read_rope(hf_config) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5.x) or `rope_theta`/`rope_scaling` (4.x)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy:
        params = {**dict(legacy), **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        return float(theta), Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"rope_type {rope_type!r} is not supported; expected 'default' or 'llama3'")
