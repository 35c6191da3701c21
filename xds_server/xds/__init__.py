"""The xDS protocol side of the control plane: snapshots per sidecar group, their cache, ADS (SotW
and Delta), sync status, CSDS, node and peer identity, the health service."""
