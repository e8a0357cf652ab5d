"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a prompt, or chat messages rendered as a chat completion would
render them) -> ``{count, max_model_len, tokens, token_strs}``, ``POST /detokenize`` -> ``{prompt}``, ``GET
/tokenizer_info`` -> the tokenizer's configuration. Eval harnesses count tokens and fit contexts with them (and,
without ``/tokenizer_info``, some try to download the served name from the Hub)."""

import json

from fastapi import Request
from pydantic import ValidationError

from zipage_jax.entrypoints.protocol import (APIError, DetokenizeRequest, TokenizeChatRequest,
                                             TokenizeCompletionRequest, chat_template_kwargs, validation_error)
from zipage_jax.entrypoints.tokenizing import Tokenizing


async def parse_body(request: Request, model):
    """``request``'s JSON body as ``model`` (None: by its fields, for /tokenize), or the 400 FastAPI's own validation
    would give (``validation_error``)."""
    try:
        data = json.loads(await request.body())
    except ValueError as exc:  # malformed JSON, or bytes that are no UTF-8
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    if model is None:  # /tokenize: chat messages or a prompt
        model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


class ServingTokenization:
    def __init__(self, tokenizing: Tokenizing, max_model_len: int, check_model):
        self.tokenizing, self.max_model_len, self.check_model = tokenizing, max_model_len, check_model

    async def tokenize(self, request: Request) -> dict:
        body = await parse_body(request, None)
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            body.check()
            prompt = await self.tokenizing.render_chat([m.as_template_message() for m in body.messages],
                                                       **chat_template_kwargs(body))
            ids = await self.tokenizing.encode(prompt, body.add_special_tokens, field=None)
        else:
            ids = await self.tokenizing.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": self.tokenizing.token_strs(ids) if body.return_token_strs else None}

    async def detokenize(self, request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest)
        self.check_model(body.model)
        vocab = self.tokenizing.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be ints in [0, {vocab})", param="tokens")
        return {"prompt": await self.tokenizing.decode(body.tokens)}

    async def info(self) -> dict:
        return await self.tokenizing.run(self.tokenizing.info)
