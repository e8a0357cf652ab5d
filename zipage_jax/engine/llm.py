"""The offline ``LLM`` API, shaped like vLLM's: batches of prompts or conversations in, one output each out."""

import dataclasses
import itertools
import time

from tqdm import tqdm  # the text bar: tqdm.auto warns in notebooks without ipywidgets

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.sampling_params import SamplingParams


class LLM:
    """Offline batch generation: ``LLM(model).generate(prompts, sampling_params)``."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine.from_kwargs(model, **engine_kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.get_tokenizer()

    def get_tokenizer(self):
        """transformers' tokenizer of the model (loaded on first use after a warm start, whose engine encodes and
        decodes through the stored Rust pipeline: no transformers import)."""
        return self.engine.get_tokenizer()

    def metrics(self) -> dict:
        return self.engine.metrics()

    def warmup(self, use_tqdm: bool = True, ready_early: bool = False) -> dict:
        """Compile every program the engine can need (see ``LLMEngine.warmup``), with a progress bar; with
        ``ready_early`` only a light load's, the rest in the background."""
        with tqdm(desc="compiling", unit="program", disable=not use_tqdm) as bar:
            def progress(done, total, name, seconds):
                bar.total = total
                bar.set_postfix_str(name)
                bar.update(1)
            return self.engine.warmup(progress, ready_early=ready_early)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Like vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a list of
        them, rendered with the tokenizer's chat template (or ``chat_template``), then generated; one
        ``RequestOutput`` per conversation."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: expected a conversation (a list of messages) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("chat_template: the tokenizer has none; pass chat_template= or use generate()")
        prompts = []
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, (list, tuple)) or not all(
                    isinstance(m, dict) and {"role", "content"} <= set(m) for m in conversation):
                raise ValueError(f"messages[{i}]: a conversation is a list of {{'role', 'content'}} dicts")
            prompts.append(self.tokenizer.apply_chat_template(list(conversation), chat_template=template,
                                                              add_generation_prompt=add_generation_prompt,
                                                              tokenize=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order (``n`` completions each)."""
        prompts = _normalize_prompts(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params or SamplingParams()] * len(prompts)
        groups, added = [], []
        try:
            for prompt, params in zip(prompts, per_prompt):
                base = f"gen-{next(self._ids)}"
                ids = []
                for j in range(params.n if params else 1):
                    sub = params
                    if j:  # choice j: seed + j, and the prompt's logprobs are choice 0's
                        seed = params.seed + j if params.seed is not None else None
                        sub = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
                    self.engine.add_request(f"{base}-{j}", prompt, sub)
                    ids.append(f"{base}-{j}")
                    added.append(f"{base}-{j}")
                groups.append(ids)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step(only_finished=True)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(added), desc="generate", disable=not use_tqdm or not added, unit="req")
        start, compiled_before, generated = time.perf_counter(), self._compile_seconds(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(only_finished=True):
                if out.request_id in added and out.request_id not in finals:
                    finals[out.request_id] = out
                    generated += len(out.outputs[0].token_ids)
                    bar.update(1)
                    # compiles on first use are reported apart, so the rate is the steady generation rate
                    compiling = self._compile_seconds() - compiled_before
                    generating = max(time.perf_counter() - start - compiling, 1e-9)
                    bar.set_postfix_str(f"{generated / generating:.1f} tok/s"
                                        + (f", compiled {compiling:.1f}s" if compiling else ""))
        bar.close()
        results = []
        for ids in groups:
            first = finals[ids[0]]
            completions = []
            for j, request_id in enumerate(ids):
                c = finals[request_id].outputs[0]
                c.index = j
                completions.append(c)
            results.append(RequestOutput(first.request_id.rsplit("-", 1)[0], first.prompt, first.prompt_token_ids,
                                         completions, True, first.metrics, first.prompt_logprobs))
        return results

    def _compile_seconds(self) -> float:
        return self.engine.stats().worker.compile_s


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"prompts[{i}]: expected str or list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]
