"""zipage_jax: JAX + Pallas inference engine with Compressed PagedAttention."""
