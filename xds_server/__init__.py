"""The xDS control plane: desired state, resources, snapshots, ADS, sync status, rollouts."""
