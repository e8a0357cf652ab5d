"""Synthetic long-reasoning tasks and the tokenizer / export helpers of the shipped tiny model.

``TASKS`` maps each task's name to its problem sampler ``(n, seed, split) -> problems``; every problem has
``question``, ``answer``, ``split``, ``solution()`` and ``conclusion`` (the end of the solution computed once from
the finished scratchpad, which training weights up).
"""

from zipage_jax.tasks import interleaved_sums, repeated_addition, stored_product
from zipage_jax.tasks.repeated_addition import Problem, boxed_answer, sample_problems

TASKS = {"repeated_addition": repeated_addition.sample_problems, "interleaved_sums": interleaved_sums.sample_problems,
         "stored_product": stored_product.sample_problems}

__all__ = ["TASKS", "Problem", "boxed_answer", "sample_problems"]
