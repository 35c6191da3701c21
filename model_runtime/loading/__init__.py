"""Weights and tokenizer in: GGUF, safetensors Llama folders and sealed (encrypted) files ->
a built model with its accelerators attached (`loader.load`)."""
