"""Test-session setup: two simulated CPU devices so tensor-parallel paths run on CPU (must precede jax import)."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
