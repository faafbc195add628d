"""Tensor parallelism: the process group each rank joins, and how a model's heads split."""
