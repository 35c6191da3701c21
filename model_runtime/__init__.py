"""The model runtime: Llama-family model, INT4/16-bit weights, KV cache, scheduler, gRPC service."""
