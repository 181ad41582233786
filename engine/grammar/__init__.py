"""Structured output: what a request's output must match, compiled into token masks (xgrammar)."""
