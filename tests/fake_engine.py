"""A model-free stand-in for `LLMEngine` with the same contract, so the server tests need no checkpoint.

The "model" echoes the prompt: choice token i is `prompt[(offset + i) % len(prompt)]`, then end-of-sequence
after `len(prompt)` tokens. Greedy requests use offset 0; sampled ones draw the offset from their seed. It
holds `ceil(tokens / block_size)` pages per running request, admits requests FIFO while `max_num_seqs` and the
page pool allow, and records every thread that touches it so tests can check it is driven from one thread.
"""

import collections
import dataclasses
import math
import random
import threading
import time
import types

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from zipage_jax.detokenizer import IncrementalDetokenizer
from zipage_jax.outputs import CompletionOutput, RequestOutput
from zipage_jax.sampling import GREEDY_TEMPERATURE, SamplingParams

SPECIALS = ("<|eos|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (so multi-byte characters span tokens) plus chat specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", chat_template=CHAT_TEMPLATE)


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    offset: int
    detok: IncrementalDetokenizer
    out_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None


class FakeEngine:
    def __init__(self, *, max_model_len: int = 512, max_num_seqs: int = 8, num_pages: int = 512,
                 block_size: int = 16, step_delay_s: float = 0.002):
        self.tokenizer = byte_tokenizer()
        self.model_name = "fake-echo"
        self.max_model_len = max_model_len
        self.config = types.SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                            block_size=block_size)
        self.num_pages = num_pages
        self.step_delay_s = step_delay_s
        self.eos_token_id = self.tokenizer.eos_token_id
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[str, _Request] = {}
        self.requests: dict[str, _Request] = {}
        self.retired: list[_Request] = []  # aborted, reported by the next step
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.prompt_tokens = self.generated_tokens = self.finished = 0

    # -- the contract ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams):
        self._touch()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: empty prompt")
        if not all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {len(self.tokenizer)})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room within max_model_len {self.max_model_len}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        greedy = params.temperature < GREEDY_TEMPERATURE
        offset = 0 if greedy else random.Random(params.seed).randrange(len(ids))
        request = _Request(request_id, ids, params, offset,
                           IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str):
        self._touch()
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        request.finish = "abort"
        self.retired.append(request)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.waiting or self.running or self.retired)

    def step(self) -> list[RequestOutput]:
        self._touch()
        time.sleep(self.step_delay_s)
        self._admit()
        changed = self.retired
        self.retired = []
        for request in list(self.running.values()):
            self._generate_one(request)
            changed.append(request)
            if request.finish is not None:
                del self.running[request.request_id]
                del self.requests[request.request_id]
                self.finished += 1
        return [self._output(r) for r in changed]

    def metrics(self) -> dict:
        self._touch()
        used = self.pages_used()
        return dict(num_running=len(self.running), num_waiting=len(self.waiting), num_preempted=0,
                    kv_pages_total=self.num_pages, kv_pages_used=used, page_occupancy=used / self.num_pages,
                    prefix_cache_hit_rate=0.0, prompt_tokens_total=self.prompt_tokens,
                    generation_tokens_total=self.generated_tokens, prefill_tokens_per_s=0.0,
                    decode_tokens_per_s=0.0, compression_time_share=0.0, num_requests_finished=self.finished)

    # -- the fake model --------------------------------------------------------------------------------------
    def expected_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """What a request produces, for test oracles (before stop strings)."""
        greedy = params.temperature < GREEDY_TEMPERATURE
        offset = 0 if greedy else random.Random(params.seed).randrange(len(prompt_ids))
        ids = [prompt_ids[(offset + i) % len(prompt_ids)] for i in range(len(prompt_ids))]
        return ids if params.ignore_eos else ids + [self.eos_token_id]

    def pages_used(self) -> int:
        return sum(self._pages(r) for r in self.running.values())

    def _pages(self, request: _Request) -> int:
        return math.ceil((len(request.prompt_ids) + len(request.out_ids) + 1) / self.config.block_size)

    def _admit(self):
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if self.pages_used() + self._pages(self.waiting[0]) > self.num_pages:
                return
            request = self.waiting.popleft()
            self.running[request.request_id] = request
            self.prompt_tokens += len(request.prompt_ids)

    def _generate_one(self, request: _Request):
        i, ids, params = len(request.out_ids), request.prompt_ids, request.params
        token = ids[(request.offset + i) % len(ids)] if (i < len(ids) or params.ignore_eos) else self.eos_token_id
        request.out_ids.append(token)
        request.logprobs.append(-0.5 - 0.01 * (token % 7))
        self.generated_tokens += 1
        request.detok.add(token)
        n = len(request.out_ids)
        if n >= params.min_tokens and (token in params.stop_token_ids
                                       or (token == self.eos_token_id and not params.ignore_eos)):
            request.finish = "stop"
        elif params.stop:
            hits = [(pos, s) for s in params.stop if (pos := request.detok.text.find(s)) >= 0]
            if hits:
                request.detok.text = request.detok.text[:min(hits)[0]]
                request.finish = "stop"
        if request.finish is None and n >= params.max_tokens:
            request.finish = "length"

    def _output(self, request: _Request) -> RequestOutput:
        want = request.params.logprobs is not None
        completion = CompletionOutput(index=0, text=request.detok.text, token_ids=list(request.out_ids),
                                      cumulative_logprob=sum(request.logprobs) if want else None,
                                      logprobs=list(request.logprobs) if want else None,
                                      finish_reason=request.finish)
        return RequestOutput(request.request_id, None, request.prompt_ids, [completion],
                             request.finish is not None, {})

    def _touch(self):
        self.threads.add(threading.get_ident())
