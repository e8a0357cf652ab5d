"""``python -m zipage_jax.eval``: batch evaluation of a JSONL task (``zipage_jax.entrypoints.eval``)."""

from zipage_jax.entrypoints.eval import main

if __name__ == "__main__":
    main()
