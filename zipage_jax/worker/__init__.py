"""The device side: compiled step programs over the donated device state, the KV cache and its memory plan."""
