"""Native CPU kernels: the int4 / int8 weight-only matmuls (qmm.c) and the decode step (step.c),
committed as builds per instruction set (`python -m model_runtime.kernels.build`). `isas` picks
the build this CPU runs, `qmm` loads the matmuls, `compute` chooses a model's compute dtype."""
