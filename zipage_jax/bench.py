"""``python -m zipage_jax.bench``: the engine benchmarks (``zipage_jax.benchmarks.cli``)."""

from zipage_jax.benchmarks.cli import main

if __name__ == "__main__":
    main()
