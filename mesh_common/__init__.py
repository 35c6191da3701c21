"""What the control plane, the sidecar and the CLI share below all of them: the mesh's vocabulary
and small operating-system helpers."""
