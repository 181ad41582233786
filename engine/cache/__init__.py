"""The paged KV cache: its device tensors, the block manager, and prefix caching."""
