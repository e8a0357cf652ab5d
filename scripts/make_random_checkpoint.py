"""Write a random-weight HF checkpoint of a real model's shapes, for start-up and throughput benchmarks.

    python scripts/make_random_checkpoint.py /tmp/qwen3-8b --model-shape qwen3-8b

With torch (the GPU machine has it) the model is built on the GPU in bf16 and saved with ``save_pretrained``
(Qwen3-8B: 16.4 GB in about 20 s); without it, random Params from jax are exported (small shapes: the export
holds the model in f32 on the host). ``--num-layers`` trims the layer count (a few hundred MB for CPU runs). The
tokenizer has one word per id, so whatever the model samples decodes to text.
"""

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import DEFAULT_MODEL


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--model-shape", choices=[k for k, v in MODEL_SHAPES.items() if v.model_type == "qwen3"],
                        default="qwen3-8b")
    parser.add_argument("--num-layers", type=int, default=None, help="layers (default: the model's)")
    args = parser.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    if args.num_layers:
        shape = dataclasses.replace(shape, num_layers=args.num_layers)
    start = time.perf_counter()
    if importlib.util.find_spec("torch") is None:
        export_from_jax(shape, args.out)
    else:
        save_from_torch(shape, args.out)
    save_tokenizer(shape.vocab_size, args.out)
    print(f"{args.model_shape} checkpoint written to {args.out} in {time.perf_counter() - start:.1f}s")


def save_tokenizer(vocab_size: int, out):
    """A tokenizer with one word per id (``<t17>`` is id 17), so any id the random model samples decodes to
    text and a server streams a chunk for every token, as with a real vocabulary; the shipped model's chat
    template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    template = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text()).get("chat_template")
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<t2>", unk_token="<t0>",
                            chat_template=template).save_pretrained(out)


def arch(shape) -> dict:
    return dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps,
                rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_word_embeddings,
                max_position_embeddings=shape.max_position_embeddings)


def export_from_jax(shape, out):
    import jax
    import jax.numpy as jnp

    from zipage_jax.models.weights import init_random_params
    from zipage_jax.tasks.export import save_hf_checkpoint

    save_hf_checkpoint(init_random_params(shape, jax.random.key(0), jnp.bfloat16), arch(shape), out)


def save_from_torch(shape, out):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**arch(shape), eos_token_id=2)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: Qwen3-32B in f32 would not fit an 80 GB card
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)


if __name__ == "__main__":
    main()
