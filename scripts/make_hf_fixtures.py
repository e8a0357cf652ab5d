"""Build the tiny random HF checkpoints and reference outputs under tests/fixtures/hf/, and HF's prompt logprobs
of the shipped model (tests/fixtures/tiny_reasoner_prompt_logprobs.npz).

Run with a torch environment (the test suite itself never needs torch), e.g. Python 3.11 with
torch==2.13.0 (CPU) and transformers==5.17.0:
    python scripts/make_hf_fixtures.py [--only checkpoints|prompt-logprobs]
Each checkpoint directory gets config.json, model.safetensors, a char-level tokenizer and expected.npz with
  input_ids [B,T], logits [B,T,V] (HF float32, eager attention),
  prompt_ids [P,Lmax] / prompt_lens [P], greedy_ids [P,N] (generate, do_sample=False) and
  greedy_margins [P,N] (top-1 minus top-2 logit at each step, to recognise genuine near-ties).
The prompt-logprobs file holds, for prompts of the shipped model (float32, eager attention):
  prompt_ids [P,Lmax] / prompt_lens [P]; at each position t >= 1 of each prompt, the log-softmax of the logits
  at t-1: logprobs [P,Lmax] of token t (NaN at t = 0 and past the prompt), ranks [P,Lmax] (1 + tokens strictly
  more likely), top_ids / top_logprobs [P,Lmax,TOP_LOGPROBS] (descending).
Seeded: rerunning reproduces the same files.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

VOCAB_SIZE = 256
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PROMPTS = ["hello world", "The quick brown fox", "1+2=3, 4+5="]
NEW_TOKENS = 24
SEQ_LEN, NUM_SEQS = 16, 3
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "zipage_jax/assets/tiny-reasoner"
TOP_LOGPROBS = 5


def shipped_model_prompts() -> list[str]:
    """A question of the shipped model's task with the start of its reference reasoning (the format of
    zipage_jax/tasks/repeated_addition.py: line k holds k*A as 7 digits, least significant first), and plain
    text outside its domain."""
    a, lines = 67815, 14
    reasoning = "".join(f"{k:02d}:{str(k * a).zfill(7)[::-1]}\n" for k in range(1, lines + 1))
    chat = f"<|im_start|>user\nWhat is {a}*55?<|im_end|>\n<|im_start|>assistant\n"
    return [chat + reasoning, "The quick brown fox jumps over the lazy dog. 0123456789"]

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    dtype="float32",
)

CHECKPOINTS = {
    "llama": ("llama", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3_rope": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    # 8 query heads of 16 dims on a 64-wide model: head_dim is explicit, not hidden / heads.
    "qwen3_untied": (
        "qwen3",
        dict(tie_word_embeddings=False, rope_theta=1000000.0, num_attention_heads=8, num_key_value_heads=2),
    ),
}


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Character-level WordLevel tokenizer: specials, printable ASCII, then filler tokens up to VOCAB_SIZE."""
    chars = [chr(c) for c in range(32, 127)]
    fillers = [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + fillers)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights of a size that gives O(1) activations and well separated logits; norms near 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.1 * noise)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(3.0 * noise / p.shape[1] ** 0.5)  # layer outputs dominate the token's own embedding
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def make_checkpoint(out: Path, model_type: str, overrides: dict, seed: int, tokenizer) -> None:
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    generator = torch.Generator().manual_seed(seed)
    randomize(model, generator)
    model.save_pretrained(out)
    model.generation_config.eos_token_id = None  # always generate NEW_TOKENS, even past <eos>
    tokenizer.save_pretrained(out)

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB_SIZE, size=(NUM_SEQS, SEQ_LEN), dtype=np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)).logits.float().numpy()

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompt_ids = np.zeros((len(prompts), max(map(len, prompts))), dtype=np.int32)
    greedy_ids = np.zeros((len(prompts), NEW_TOKENS), dtype=np.int32)
    margins = np.zeros((len(prompts), NEW_TOKENS), dtype=np.float32)
    gen_config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
        bos_token_id=1, output_logits=True, return_dict_in_generate=True,
    )
    for i, ids in enumerate(prompts):
        prompt_ids[i, : len(ids)] = ids
        with torch.no_grad():
            result = model.generate(torch.tensor([ids]), generation_config=gen_config)
        new = result.sequences[0, len(ids):].numpy()
        assert new.shape == (NEW_TOKENS,), new.shape
        greedy_ids[i] = new
        top2 = torch.stack([torch.topk(step[0].float(), 2).values for step in result.logits]).numpy()
        margins[i] = top2[:, 0] - top2[:, 1]
    np.savez_compressed(
        out / "expected.npz",
        input_ids=input_ids.astype(np.int32),
        logits=logits.astype(np.float32),
        prompt_ids=prompt_ids,
        prompt_lens=np.array([len(p) for p in prompts], dtype=np.int32),
        greedy_ids=greedy_ids,
        greedy_margins=margins,
    )


def make_prompt_logprobs(out: Path) -> None:
    """HF's log-softmax over the shipped model's prompts: the oracle of the engine's prompt logprobs."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in shipped_model_prompts()]
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    logprobs = np.full((len(prompts), width), np.nan, np.float32)
    ranks = np.zeros((len(prompts), width), np.int32)
    top_ids = np.zeros((len(prompts), width, TOP_LOGPROBS), np.int32)
    top_logprobs = np.full((len(prompts), width, TOP_LOGPROBS), np.nan, np.float32)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = prompt
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
        target = torch.tensor(prompt[1:])
        chosen = lp.gather(1, target[:, None])[:, 0]
        logprobs[i, 1:len(prompt)] = chosen.numpy()
        ranks[i, 1:len(prompt)] = (1 + (lp > chosen[:, None]).sum(-1)).numpy()
        values, top = torch.topk(lp, TOP_LOGPROBS, dim=-1)
        top_ids[i, 1:len(prompt)] = top.numpy()
        top_logprobs[i, 1:len(prompt)] = values.numpy()
    np.savez_compressed(out, prompt_ids=ids, prompt_lens=np.array([len(p) for p in prompts], np.int32),
                        logprobs=logprobs, ranks=ranks, top_ids=top_ids, top_logprobs=top_logprobs)
    print(f"{out.name}: {out.stat().st_size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures")
    parser.add_argument("--only", choices=["checkpoints", "prompt-logprobs"], default=None)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.only != "checkpoints":
        make_prompt_logprobs(args.out / "tiny_reasoner_prompt_logprobs.npz")
    if args.only == "prompt-logprobs":
        return
    tokenizer = build_tokenizer()
    for seed, (name, (model_type, overrides)) in enumerate(CHECKPOINTS.items()):
        out = args.out / "hf" / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        make_checkpoint(out, model_type, overrides, seed, tokenizer)
        print(f"{name}: {sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
