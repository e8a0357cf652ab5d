"""The engine's per-token logprobs (``{token id: Logprob}``, the position's own token first, then its most
likely alternatives by rank) in the OpenAI wire formats, as vLLM's server writes them.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; ``top_logprobs`` holds, per
token, its N most likely alternatives and itself (up to N + 1 entries, text -> logprob); a position without
logprobs (the first prompt token under echo) is null in both lists. Chat: ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [the N most likely, by rank]}]}``. Prompt logprobs (vLLM's extension): one
``{token id: {"logprob", "rank", "decoded_token"}}`` per prompt token, null for the first. JSON has no -inf:
logprobs are clamped at -9999 as OpenAI does.
"""

from collections.abc import Callable, Sequence

FLOOR = -9999.0


def _value(logprob) -> float:
    return max(logprob.logprob, FLOOR)


class TokenLabels:
    """How a token is named in logprobs: its text, or ``token_id:N`` (``return_tokens_as_token_ids``)."""

    def __init__(self, token_text: Callable[[int], str], as_ids: bool = False):
        self.token_text, self.as_ids = token_text, as_ids

    def __call__(self, token: int, logprob=None) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.token_text(token)


def _ranked(entry: dict, num: int) -> list:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num),
                  key=lambda item: item[1].rank)[:num]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict | None], num: int, label: TokenLabels,
                        text_offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        own = entry.get(token) if entry else None
        text = label(token, own)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(own))
        top = {label(t, lp): _value(lp) for t, lp in _ranked(entry, num)}
        top.setdefault(text, _value(own))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_item(token: int, logprob, label: TokenLabels) -> dict:
    text = label(token, logprob)
    # A token inside a multi-byte character has no text of its own: its bytes are not known here.
    return {"token": text, "logprob": _value(logprob), "bytes": None if "\ufffd" in text else list(text.encode())}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict], num: int, label: TokenLabels) -> dict:
    content = []
    for token, entry in zip(token_ids, entries):
        item = _chat_item(token, entry[token], label)
        item["top_logprobs"] = [_chat_item(t, lp, label) for t, lp in _ranked(entry, num)]
        content.append(item)
    return {"content": content}


def prompt_logprobs(entries: Sequence[dict | None] | None) -> list | None:
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in entries]
