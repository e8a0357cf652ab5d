"""Where a model's files are: a local directory as given, or a Hugging Face Hub id (``Qwen/Qwen3-0.6B``) fetched by
``huggingface_hub.snapshot_download`` into the Hub cache, as vLLM does; offline, a cached snapshot serves.

Only what the engine reads is fetched: the configs, the safetensors weights and the tokenizer files. The Hub is
asked first with a timeout, so without a network an id that is not cached fails within seconds with a ValueError
that says so (``snapshot_download`` alone waits on an unanswered connection without end).
"""

from pathlib import Path

FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # configs, weights, tokenizer
HUB_TIMEOUT_S = 10.0  # for the first question to the Hub, which tells whether it can be reached


def local_dir(name: str, field: str = "model", revision: str | None = None, cache_dir: str | None = None) -> str:
    """The directory holding ``name``'s files: ``name`` itself if it is a directory, else its Hub snapshot (at
    ``revision``, a branch, tag or commit; None: the default branch) in the Hub cache or ``cache_dir``. Anything
    else is a ValueError naming ``field``."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        revision = HfApi().model_info(name, revision=revision, timeout=HUB_TIMEOUT_S).sha
    except HFValidationError:
        raise ValueError(f"{field}: no directory at {name!r}, and it is no Hugging Face Hub id") from None
    except GatedRepoError:
        raise ValueError(f"{field}: {name!r} is gated on the Hugging Face Hub: accept its terms there and log in "
                         f"(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{field}: no directory at {name!r}, and no such model on the Hugging Face Hub (or it "
                         f"is private: log in with `hf auth login` or HF_TOKEN)") from None
    except HfHubHTTPError as error:
        raise ValueError(f"{field}: the Hugging Face Hub refused {name!r}: {error}") from None
    except Exception as error:  # no network (refused, unreachable, timed out) or HF_HUB_OFFLINE: the cache may serve
        try:
            return snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=FILES,
                                     local_files_only=True)
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else \
                f"the Hub ({constants.ENDPOINT}) cannot be reached: {type(error).__name__}"
            raise ValueError(f"{field}: {name!r} is no local directory and not in the Hugging Face Hub cache "
                             f"({constants.HF_HUB_CACHE}), and {why} (download it where there is a network, e.g. "
                             f"`hf download {name}`, or pass a directory)") from None
    return snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=FILES)
