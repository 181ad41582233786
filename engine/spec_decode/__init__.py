"""Speculative decoding: verifying MTP drafts, and the frequency-ranked draft vocabulary they are drawn from."""
