"""``python -m zipage_jax.serve``: the OpenAI-compatible server (``zipage_jax.entrypoints.api_server``)."""

from zipage_jax.entrypoints.api_server import main

if __name__ == "__main__":
    main()
