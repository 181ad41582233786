"""The ModelRunner and what it runs on the device: the prefill and decode steps, their CUDA graphs and capture, per-slot batch state, grammar masks and prompt logprobs."""
