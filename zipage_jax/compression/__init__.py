"""Device math of Compressed PagedAttention: scoring, top-k selection, compaction, the compression step."""

from zipage_jax.compression.compaction import gather_slots, scatter_slots
from zipage_jax.compression.scoring import ScoringConfig
from zipage_jax.compression.selection import select_slots
from zipage_jax.compression.step import CompressionPlan, compress, slot_scores

__all__ = ["CompressionPlan", "ScoringConfig", "compress", "gather_slots", "scatter_slots",
           "select_slots", "slot_scores"]
