"""Device math of Compressed PagedAttention: scoring, top-k selection, compaction, and the compression step
that composes them over a backend's kernels. Import the modules themselves (``compression.step``, ...)."""
