"""Host bookkeeping in plain Python (no jax): requests, the page pool, the scheduler, stop checks."""
