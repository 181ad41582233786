"""The schedulers over the runner: the decode batch, chunked prefill, n > 1 forks, and the thread that steps them."""
