"""The model: the Llama-family transformer in torch ops, its quantized layers, and the
accelerators the loader attaches to it (the native decode step and attention, CUDA graphs)."""
