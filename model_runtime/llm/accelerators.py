"""A built model's accelerators: its decode step in one native call (native_step.py) or, on a
CUDA device, replayed from CUDA graphs (cuda_graphs.py), and its attention in one native call a
layer (native_attention.py).

model.py runs in torch ops alone and imports none of them. The loader calls `attach` on every
model it builds; the model then asks `resolve` for each accelerator on its first use (its
`native_step` and `native_attention` start as "auto": the linears are swapped for quantized ones
and the model moved after construction, so the choice waits for the first forward that needs it).
"""

from __future__ import annotations

from model_runtime.llm import cuda_graphs, native_attention, native_step
from model_runtime.llm.model import Transformer

NAMES = ("native_step", "native_attention")


def resolve(model: Transformer, name: str) -> None:
    """Set `model.<name>` ("native_step" | "native_attention") to the accelerator that applies
    to it now, or None (torch ops)."""
    if name == "native_step":
        if model.device.type == "cuda":
            cuda_graphs.use(model, True)
        else:
            native_step.use(model, True)
    elif name == "native_attention":
        native_attention.use(model, True)
    else:
        raise ValueError(f"no accelerator {name!r}: one of {NAMES}")


def attach(model: Transformer) -> Transformer:
    """`model`, its "auto" accelerators resolved by `resolve` on first use (a copy keeps it)."""
    model.accelerate = resolve
    return model
