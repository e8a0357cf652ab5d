"""``python -m zipage_jax.serve [MODEL]``: the OpenAI-compatible server (``zipage_jax.entrypoints.api_server``).
Ctrl-C at any moment, during the imports and the engine's start too, ends it quietly (status 130)."""

import sys


def main(argv: list[str] | None = None, prog: str = "python -m zipage_jax.serve"):
    try:
        from zipage_jax.entrypoints.api_server import main as serve

        serve(argv, prog)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
