"""The request parts of structured outputs and tools (``protocol``'s models hold them): open, as the rest of a
request (an unknown field is named in the request's warning), and strict."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StructuredOutputsRequest(_Part):
    """vLLM's ``structured_outputs`` field: exactly one of ``json`` (a JSON schema), ``regex``, ``choice``,
    ``grammar`` (Lark or GBNF), ``json_object``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` is a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="JSON's whitespace: false allows any between tokens; by default JSON is laid out as "
                          "json.dumps does (a model can spend its budget on newlines otherwise).")
    whitespace_pattern: str | None = Field(None, description="JSON's whitespace: a regular expression instead.")


class JsonSchemaFormat(_Part):
    """OpenAI's ``response_format.json_schema``: the schema and its name (``strict`` is how the schema is always
    applied here: the grammar allows nothing else)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` is a BaseModel method
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def template_call(call: dict) -> dict:
    """An assistant message's call with its arguments as an object (vLLM parses them: templates write them with
    ``tojson``); as it came when they are no JSON."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(_Part):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class ChatTool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction
