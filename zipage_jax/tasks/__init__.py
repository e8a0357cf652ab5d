"""Synthetic long-reasoning tasks and the tokenizer / export helpers of the shipped tiny model."""

from .repeated_addition import Problem, boxed_answer, sample_problems

__all__ = ["Problem", "boxed_answer", "sample_problems"]
