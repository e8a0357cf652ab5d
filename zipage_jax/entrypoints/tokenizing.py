"""The server's tokenizer work, off the event loop: encoding prompts, rendering chat templates and decoding run on a
small thread pool (the Rust tokenizer releases the GIL while it encodes; a template renders in Python, which yields
the GIL every few milliseconds), so that a long prompt never stalls another client's stream. A prompt longer than
``max_prompt_chars`` is refused with a 400 before any of that work starts.
"""

import asyncio
import concurrent.futures
import functools
import json
import os

from zipage_jax.entrypoints.protocol import APIError

WORKERS = min(4, os.cpu_count() or 1)


class Tokenizing:
    """``tokenizer``: the server's (``core.tokenizer``: transformers' tokenizer, or the stored Rust pipeline with
    transformers' beside it for chat templates). ``chat_template``: the server's own template (--chat-template),
    used instead of the tokenizer's."""

    def __init__(self, tokenizer, max_prompt_chars: int, chat_template: str | None = None):
        self.tokenizer, self.max_prompt_chars, self.chat_template = tokenizer, max_prompt_chars, chat_template
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="tokenizing")
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))
        rust = getattr(tokenizer, "_tokenizer", None)  # the Rust pipeline, where there is one
        self._rust = rust if hasattr(rust, "id_to_token") else None

    async def run(self, function, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.pool,
                                                                functools.partial(function, *args, **kwargs))

    def check_chars(self, texts: list[str], field: str):
        """A 400 naming ``field`` when ``texts`` together exceed the cap (cheap: no tokenizing)."""
        chars = sum(map(len, texts))
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{field}: {chars} characters exceed this server's limit of {self.max_prompt_chars} "
                                "(--max-prompt-chars)", param=field, code="prompt_too_long")

    async def encode(self, text: str, add_special_tokens: bool, field: str | None = "prompt") -> list[int]:
        """``text``'s token ids; ``field``: the request field it came from, whose length is checked first (None: a
        rendered chat template, whose messages were)."""
        if field is not None:
            self.check_chars([text], field)
        return await self.run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def render_chat(self, messages: list[dict], field: str = "messages", **kwargs) -> str:
        """The chat template's text for ``messages``; whatever the template raises on the client's input is a 400
        naming ``field``."""
        self.check_chars([m["content"] for m in messages], field)
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        try:
            text = await self.run(self.tokenizer.apply_chat_template, messages, tokenize=False, **kwargs)
            if not isinstance(text, str):
                raise TypeError("the template did not render text")
        except Exception as exc:
            raise APIError(400, f"{field}: the chat template rejected them: {exc}", param=field) from exc
        return text

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, ids)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer can decode (added tokens included)."""
        if self._rust is not None:
            return self._rust.get_vocab_size(with_added_tokens=True)
        return len(self.tokenizer)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token as its vocabulary entry (vLLM's ``token_strs``: ``Ġthe``, not `` the``)."""
        if self._rust is not None:
            return [self._rust.id_to_token(i) for i in ids]
        return self.tokenizer.convert_ids_to_tokens(ids)

    def transformers(self):
        """transformers' tokenizer (waits for its load where the stored pipeline serves the rest)."""
        loaded = getattr(self.tokenizer, "transformers", None)
        return loaded() if callable(loaded) else self.tokenizer

    def info(self) -> dict:
        """vLLM's ``/tokenizer_info``: the tokenizer's configuration as ``tokenizer_config.json`` holds it (file paths
        left out), its class, and the server's chat template where it has its own."""
        tokenizer = self.transformers()
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        config = json.loads(json.dumps(config, default=lambda v: getattr(v, "content", str(v))))
        config["tokenizer_class"] = type(tokenizer).__name__
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config
