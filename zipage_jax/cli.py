"""``zipage-jax serve|eval|bench ...`` (the console script pyproject declares, as vLLM's ``vllm serve``): each
command forwards its arguments to ``python -m zipage_jax.<command>``'s main."""

import sys

USAGE = "usage: zipage-jax {serve,eval,bench} ...  (zipage-jax COMMAND --help for its options)"


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "serve":
        from zipage_jax.serve import main as serve

        return serve(rest, prog="zipage-jax serve")
    if command == "eval":
        from zipage_jax.eval import main as evaluate

        return evaluate(rest)
    if command == "bench":
        from zipage_jax.bench import main as bench

        return bench(rest)
    if command in ("-h", "--help"):
        print(USAGE)
        return None
    sys.exit(f"{USAGE}\nzipage-jax: error: {'no command' if command is None else f'unknown command {command!r}'}")


if __name__ == "__main__":
    main()
