"""Helpers shared by several test modules."""

import functools

from zipage_jax.sampling import SamplingParams
from zipage_jax.weights import load_hf_weights


@functools.cache
def _checkpoint_params(path, cfg, dtype):
    return load_hf_weights(path, cfg, dtype)


def checkpoint_params(engine):
    """The layer-stacked weights of the engine's checkpoint, loaded on their own for the dense oracle (the engine
    itself holds the serving layout)."""
    return _checkpoint_params(engine.config.model, engine.model_cfg, engine.dtype)


def mixed_workload(rng, vocab, count, max_len):
    """Prompts of many lengths (two sharing a prefix) and every sampling feature but the penalties."""
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(1, max_len, size=count)]
    prompts[1] = prompts[0] + prompts[1]
    params = []
    for i, max_tokens in enumerate(rng.integers(2, 24, size=count)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=[0, 5][i % 2], min_p=[0.0, 0.05][i % 4 == 1],
                                         seed=i, n=1 + i % 2, min_tokens=2, stop_token_ids=[7], logprobs=True,
                                         max_tokens=int(max_tokens)))
    return prompts, params
