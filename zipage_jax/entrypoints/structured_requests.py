"""A request's structured-output fields as the engine's ``StructuredOutputsParams``, and its ``logit_bias`` as token
ids.

A client asks for a constraint in one of several ways, all vLLM's: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``),
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and on chat a ``tool_choice``
that forces a call (``tool_calls``). A request carries at most one. It is compiled here, before anything is queued,
so a bad schema, regex or grammar is a 400 naming the field the client used.
"""

from zipage_jax.entrypoints.protocol import APIError
from zipage_jax.structured_output.params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}

Constraint = tuple[str, dict]  # (the request field it came in, StructuredOutputsParams' keyword arguments)


def requested(body) -> list[Constraint]:
    """Every constraint ``body`` carries (``response_format`` ``text`` is none)."""
    found = []
    format_ = body.response_format
    if format_ is not None and format_.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif format_ is not None and format_.type == "json_schema":
        if format_.json_schema is None or format_.json_schema.schema_ is None:
            raise APIError(400, "response_format: type json_schema needs json_schema.schema", param="response_format")
        found.append(("response_format", {"json": format_.json_schema.schema_}))
    wanted = body.structured_outputs
    if wanted is not None:
        if (wanted.model_extra or {}).get("structural_tag") is not None:
            raise APIError(400, "structured_outputs.structural_tag: not supported by this server",
                           param="structured_outputs", code="unsupported_parameter")
        kinds = {"json": wanted.json_, "regex": wanted.regex, "choice": wanted.choice, "grammar": wanted.grammar,
                 "json_object": wanted.json_object, "disable_any_whitespace": wanted.disable_any_whitespace,
                 "whitespace_pattern": wanted.whitespace_pattern}
        found.append(("structured_outputs", {k: v for k, v in kinds.items() if v is not None}))
    found += [(name, {kind: getattr(body, name)}) for name, kind in GUIDED.items() if getattr(body, name) is not None]
    return found


def with_whitespace(found: list[Constraint], body) -> list[Constraint]:
    """vLLM's ``guided_whitespace_pattern``: the JSON whitespace of whichever constraint the request gives."""
    pattern = body.guided_whitespace_pattern
    return [(field, {"whitespace_pattern": pattern, **kwargs}) for field, kwargs in found] if pattern else found


def compile_constraint(found: list[Constraint], reasoning_end: str | None) -> StructuredOutputsParams | None:
    """The one constraint of ``found`` (None without any), starting after ``reasoning_end`` when given; a 400 naming
    the field when there are several or it does not compile."""
    if not found:
        return None
    if len(found) > 1:
        (first, _), (field, _) = found[:2]
        raise APIError(400, f"{field}: a request takes one structured output constraint, and {first} already gives "
                            "one", param=field)
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs, reasoning_end=reasoning_end)
    except ValueError as exc:
        message = str(exc)
        named, colon, reason = message.partition(": ")
        if field != "structured_outputs" and colon and named.startswith("structured_outputs"):
            message = f"{field}: {reason}"  # the client's field, not the engine's
        raise APIError(400, message, param=field) from exc


def logit_bias(body) -> dict[int, float] | None:
    """``logit_bias`` with its keys as token ids (JSON's keys are strings); the values are checked by
    SamplingParams, the ids against the vocabulary by the engine."""
    if not body.logit_bias:
        return None
    bias = {}
    for key, value in body.logit_bias.items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        bias[int(key)] = value
    return bias
