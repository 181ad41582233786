"""Tensor parallelism: sharding a loaded model, its all-reduce, local rank processes and their control channel."""
