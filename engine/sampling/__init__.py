"""A request's sampling parameters, penalties and the sampler: logits in, tokens and logprobs out, on the device."""
