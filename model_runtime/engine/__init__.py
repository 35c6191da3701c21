"""Running the model: the engine's continuous batching over a paged KV cache with prefix reuse,
fair share per tenant, sampling, speculative drafts, and the one-thread OpenMP discipline."""
