"""The peer of ``bench throughput``: HF transformers' continuous batching (paged attention) on the same requests.

    python -m zipage_jax.benchmarks.hf_peer SPEC.json OUT.json

Run by ``throughput_bench.run_peer`` in a subprocess, before the JAX process takes the device's memory. SPEC holds
the model (a checkpoint directory, or a ``bench.MODEL_SHAPES`` name for random bf16 weights made on the device),
the prompts (token ids) and each request's output length (optionally ``device``, ``cuda`` unless it says otherwise,
``num_blocks`` and ``max_batch_tokens``, the pages of HF's cache and its tokens a step, sized from the device's
free memory unless given). Every request streams, so the tokens of requests still
running when the window of ``duration`` seconds closes are counted. OUT is written as soon as the window closes.
"""

import json
import os
import sys
import time


def build_model(spec):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    device = spec.get("device", "cuda")
    if spec["model"]:
        return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).to(device)
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES

    s = MODEL_SHAPES[spec["model_shape"]]
    config = Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                         rope_theta=s.rope_theta, tie_word_embeddings=s.tie_word_embeddings,
                         max_position_embeddings=s.max_position_embeddings, eos_token_id=None)
    torch.manual_seed(spec["seed"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def second_half_rate(samples: list[dict]) -> float | None:
    """Tokens a second over the window's second half (``samples``: time_s, generated; the last one is the
    window's end): the peer's steady rate, without its admission and prefill ramp."""
    end = samples[-1]
    half = next(s for s in samples if s["time_s"] >= end["time_s"] / 2)
    seconds = end["time_s"] - half["time_s"]
    return (end["generated"] - half["generated"]) / seconds if seconds > 0 else None


def run(spec) -> dict:
    import inspect

    import torch
    import transformers
    from transformers import GenerationConfig

    start = time.perf_counter()
    model = build_model(spec).eval()
    init_s = time.perf_counter() - start
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(spec["max_tokens"]), eos_token_id=None)
    options = dict(generation_config=generation, block=False, timeout=1)
    if "continuous_batching_config" in inspect.signature(model.continuous_batching_context_manager).parameters:
        from transformers import ContinuousBatchingConfig  # a separate batching config; its fields vary by version

        fields = inspect.signature(ContinuousBatchingConfig).parameters
        page = "page_size" if "page_size" in fields else "block_size"  # renamed in 5.17
        wanted = {page: spec["page_size"], "max_requests_per_batch": spec["max_batch"],  # unset: from free memory
                  "num_blocks": spec.get("num_blocks"), "max_batch_tokens": spec.get("max_batch_tokens")}
        options["continuous_batching_config"] = ContinuousBatchingConfig(
            **{k: v for k, v in wanted.items() if k in fields and v is not None})
    counts, finished = {}, 0
    with model.continuous_batching_context_manager(**options) as manager:
        ready_s = time.perf_counter() - start  # model + manager + CUDA-graph warm-up
        t0 = time.perf_counter()
        for prompt, max_tokens in zip(spec["prompts"], spec["max_tokens"]):
            manager.add_request(prompt, max_new_tokens=max_tokens, streaming=True)
        samples, last = [], 0.0
        while finished < len(spec["prompts"]):
            now = time.perf_counter() - t0
            if now >= spec["duration"]:
                break
            result = manager.get_result(timeout=0.2)
            if result is not None:
                counts[result.request_id] = len(result.generated_tokens)
                finished += result.is_finished()
                if result.error:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
            if now - last >= 1.0:
                last = now
                samples.append(dict(time_s=now, generated=sum(counts.values())))
        wall = time.perf_counter() - t0
        tokens = sum(counts.values())
        samples.append(dict(time_s=wall, generated=tokens))
        return dict(name="hf", transformers_version=transformers.__version__, torch_version=torch.__version__,
                    attn_implementation=model.config._attn_implementation,
                    device=torch.cuda.get_device_name() if model.device.type == "cuda" else str(model.device),
                    init_s=init_s, startup_s=ready_s, generation_s=wall, generated_tokens=tokens,
                    requests=len(spec["prompts"]), requests_finished=finished, tokens_per_s=tokens / wall,
                    tokens_per_s_second_half=second_half_rate(samples),
                    tokens_per_s_incl_startup=tokens / (ready_s + wall), history=samples)


def main():
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}), flush=True)
    os._exit(0)  # the manager's background thread may still be draining: the numbers are written


if __name__ == "__main__":
    main()
