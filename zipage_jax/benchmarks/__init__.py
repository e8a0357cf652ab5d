"""Engine benchmarks (python -m zipage_jax.bench): decode, scheduling, start-up, throughput, serving,
compression, accuracy sweeps, the HF peer, profiling."""
