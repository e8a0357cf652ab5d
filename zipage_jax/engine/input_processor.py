"""Every check a request passes before it is queued, in one place for the offline API and the server: the prompt
(tokenized if text, truncated, within the vocabulary), its length against ``max_model_len`` with ``max_tokens``
(vLLM's rule, ``completion_budget``), logit-bias ids within the vocabulary, and a per-request KV budget the engine can honour. Bad input is a
``ValueError`` naming the parameter; nothing is changed before every check has passed.
"""

import dataclasses

from zipage_jax.config import EngineConfig
from zipage_jax.sampling_params import SamplingParams, completion_budget


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt's text (of its kept tokens, if truncated); None: given as token ids
    params: SamplingParams  # with ``max_tokens`` resolved against the context


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, num_pages: int):
        self.config, self.vocab_size, self.max_model_len, self.num_pages = config, vocab_size, max_model_len, num_pages

    def process(self, prompt: str | list[int], params: SamplingParams, tokenizer, *,
                reject_over_length: bool = False) -> ProcessedPrompt:
        """``prompt`` as token ids and ``params`` with its ``max_tokens`` resolved: capped to what the prompt
        leaves of the context (the offline API), or, with ``reject_over_length`` (the server's rule), refused
        beyond it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        if text is not None and tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=False) if text is not None else list(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:  # vLLM's truncation: the prompt's last tokens
            ids = ids[-keep:]
            text = tokenizer.decode(ids) if text is not None else None
        if not ids:
            raise ValueError("prompt: empty prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size})")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
            raise ValueError(f"logit_bias: token id {params.logit_bias[-1][0]} is out of vocabulary (the model "
                             f"has {self.vocab_size} tokens)")
        max_tokens = completion_budget(len(ids), params.max_tokens, self.max_model_len, reject=reject_over_length)
        self.check_kv_budget(params.kv_budget_pages)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return ProcessedPrompt(ids, text, params)

    def check_kv_budget(self, budget: int | None):
        """A per-request KV budget must be usable: compression on, and room for the protected window and sinks."""
        if budget is None:
            return
        config = self.config
        if not config.compression:
            raise ValueError("kv_budget_pages: the engine runs with compression off (start it with compression=True)")
        if budget * config.page_size < config.scoring.window + config.scoring.sink_tokens:
            raise ValueError(f"kv_budget_pages: {budget} pages of {config.page_size} tokens cannot hold the "
                             f"protected window ({config.scoring.window}) and sinks ({config.scoring.sink_tokens})")
        if budget + 1 > self.num_pages - 1:
            raise ValueError(f"kv_budget_pages: {budget} + 1 pages exceed the pool of {self.num_pages - 1}")
