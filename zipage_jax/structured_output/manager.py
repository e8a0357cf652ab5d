"""The host side of constrained decoding: one llguidance matcher per constrained request, the token bitmask rows
its steps apply, and the matcher advanced on every accepted token.

A step's program applies a bitmask row to every sampled row (``layers.sampler.apply_token_bitmask``), read from a
device table indexed by the request's token-buffer row; rows of unconstrained requests hold all ones and are never
written, so a batch without a grammar pays one masked select and no transfer. The manager writes only the rows of
the constrained requests a step samples, and puts back all ones in a row a constrained request has left.

The mask of a request's next token needs its previous token on the host; the engine reads a step back before
scheduling the next when a constrained request waits on it (``LLMEngine.step``). Preemption keeps a request's
output tokens, so its matcher never rolls back; a request that ends drops its matcher.
"""

import dataclasses
import functools
import logging

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Grammar:
    request: object  # core.request.Request
    matcher: object  # llguidance.LLMatcher
    started: bool  # past the reasoning block (or constrained from the first token)
    marker: tuple[int, ...]  # the reasoning block's end, as token ids (empty: none)


@dataclasses.dataclass(frozen=True)
class TokenBitmask:
    """A step's writes into the device bitmask table: ``rows [n]`` token-buffer rows, ``masks [n, words]`` int32
    (bit ``t % 32`` of word ``t // 32`` allows token ``t``)."""

    rows: np.ndarray
    masks: np.ndarray


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if tokenizer is None:
            raise ValueError("structured_outputs: this engine has no tokenizer (it serves token ids only)")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self.grammars: dict[str, _Grammar] = {}
        self._dirty: dict[int, str] = {}  # token rows holding a constrained request's mask -> its request id
        self._ll_tokenizer = None

    # -- requests ------------------------------------------------------------------------------------------
    def add(self, request):
        """Bind the request's constraint to the tokenizer; a grammar llguidance refuses is a ValueError (nothing is
        kept)."""
        import llguidance

        spec = request.sampling_params.structured_outputs
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec.definition)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {matcher.get_error().strip().splitlines()[0]}")
        marker = ()
        if spec.reasoning_end is not None:
            marker = tuple(self.tokenizer.encode(spec.reasoning_end, add_special_tokens=False))
        started = not marker or _contains(request.prompt_token_ids, marker)
        self.grammars[request.request_id] = _Grammar(request, matcher, started, marker)

    def remove(self, request):
        self.grammars.pop(request.request_id, None)

    def __bool__(self) -> bool:
        """Whether a step may need table writes (a constrained request, or a row one left that is not reset)."""
        return bool(self.grammars or self._dirty)

    def waits_for_tokens(self) -> bool:
        """Whether a constrained request has a token in flight (its next mask needs that token on the host)."""
        return any(g.request.num_pending for g in self.grammars.values())

    def accept(self, request, token: int) -> bool:
        """Advance the request's matcher past its newest token; True when the constraint is complete (or broken:
        a token the mask allowed that the matcher refuses, which is logged) and the request should end."""
        grammar = self.grammars.get(request.request_id)
        if grammar is None:
            return False
        if not grammar.started:
            grammar.started = _ends_with(request, grammar.marker)
            return False
        if token in self.eos_token_ids and grammar.matcher.is_accepting():
            return True
        if not grammar.matcher.consume_token(token):
            log.warning("request %s: token %d breaks its %s constraint (%s); ending it", request.request_id, token,
                        request.sampling_params.structured_outputs.kind, grammar.matcher.get_error())
            return True
        return grammar.matcher.is_stopped()

    # -- a step's masks ------------------------------------------------------------------------------------
    def bitmask(self, sampled) -> TokenBitmask | None:
        """The table writes before a step that samples the requests ``sampled``: each constrained one's mask at
        its token row, and all ones back in the rows constrained requests left; None when nothing changes."""
        import llguidance.numpy as llnp

        active = [g for g in (self.grammars.get(r.request_id) for r in sampled) if g is not None and g.started]
        rows = [g.request.token_row for g in active]
        written = set(rows)
        stale = [row for row, rid in self._dirty.items()
                 if row not in written and (rid not in self.grammars or self.grammars[rid].request.token_row != row)]
        for row in stale:
            del self._dirty[row]
        if not rows and not stale:
            return None
        masks = np.full((len(rows) + len(stale), self.words), -1, np.int32)
        words = masks.view(np.uint32)
        if len(active) > 1:  # on llguidance's threads, outside the GIL
            llnp.fill_next_token_bitmask_par(self.executor, [(g.matcher, i) for i, g in enumerate(active)], masks)
        elif active:
            llnp.fill_next_token_bitmask(active[0].matcher, masks, 0)
        for i, grammar in enumerate(active):
            if grammar.matcher.is_accepting():  # every end-of-sequence id of the model ends a complete output
                for eos in self.eos_token_ids:
                    words[i, eos // 32] |= np.uint32(1 << (eos % 32))
            self._dirty[rows[i]] = grammar.request.request_id
        return TokenBitmask(np.asarray(rows + stale, np.int32), masks)

    @functools.cached_property
    def executor(self):
        """llguidance's thread pool for the masks of a batch."""
        import llguidance

        return llguidance.LLExecutor()

    # -- the tokenizer -------------------------------------------------------------------------------------
    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer, built on first use (a second or so for a large vocabulary)."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._ll_tokenizer


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """An ``llguidance.LLTokenizer`` of ``tokenizer`` (transformers' fast tokenizer or the engine's stored
    pipeline): from its Rust pipeline where llguidance reads the decoder (byte-level BPE, byte fallback), else from
    each token's decoded text (character-level vocabularies such as the shipped model's)."""
    import llguidance

    pipeline = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
    eos = list(eos_token_ids)
    try:
        return llguidance.LLTokenizer(pipeline.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        pass
    size = pipeline.get_vocab_size(with_added_tokens=True)
    special = {i for i, t in pipeline.get_added_tokens_decoder().items() if t.special}

    class Tokens:
        eos_token_id, bos_token_id = eos[0], None
        tokens = [b"" if i in special else pipeline.decode([i], skip_special_tokens=False).encode()
                  for i in range(size)] + [b""] * max(vocab_size - size, 0)
        special_token_ids = sorted(special)

        def __call__(self, text):
            text = text.decode() if isinstance(text, bytes) else text
            return pipeline.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab_size, eos_token=eos)


def _ends_with(request, marker: tuple[int, ...]) -> bool:
    """Whether the request's known tokens end with ``marker`` (its last few only: this runs on every token)."""
    n, m = len(request.output_logprobs), len(marker)
    tail = request.prompt_token_ids[-m:] + request.output_token_ids[max(n - m, 0):n]
    return tuple(tail[-m:]) == marker


def _contains(ids: list[int], marker: tuple[int, ...]) -> bool:
    n = len(marker)
    return any(tuple(ids[i:i + n]) == marker for i in range(len(ids) - n + 1))
