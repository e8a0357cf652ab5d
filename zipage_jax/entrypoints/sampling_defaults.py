"""vLLM's ``--generation-config``: the sampling defaults a model's creator ships in ``generation_config.json``
apply to what a request leaves unset (``auto``, vLLM's default), or nothing does (``vllm``), or a directory's file
does; ``--override-generation-config`` sets fields over them. vLLM reads the same fields: temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as the default max_tokens."""

import json
import logging
import pathlib

from zipage_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # its name -> ours


def sampling_defaults(source: str, model_path: str | None, overrides: dict | None = None) -> dict:
    """SamplingParams fields: from ``source``'s generation config (``auto``: the model's directory, ``vllm``: none,
    else a directory) under ``overrides`` (vLLM's names). A ValueError names the option at fault."""
    defaults = {}
    if source != "vllm":
        directory = model_path if source == "auto" else source
        if source != "auto" and not pathlib.Path(source).is_dir():
            raise ValueError(f"generation_config: {source!r} is neither auto, vllm nor a directory")
        path = pathlib.Path(directory or "") / "generation_config.json"
        if directory is not None and path.is_file():
            config = json.loads(path.read_text())
            defaults = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    unknown = sorted(set(overrides or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown} are not sampling defaults; known: {sorted(FIELDS)}")
    defaults.update({FIELDS[name]: value for name, value in (overrides or {}).items()})
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"generation_config: its defaults are invalid: {error}") from None
    if defaults:
        log.info("sampling defaults from the model's generation config (a request's own fields win; "
                 "--generation-config vllm leaves them out): %s", defaults)
    return defaults
