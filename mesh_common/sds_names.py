"""SDS names shared by the sidecar, which serves the secrets to its Envoy (sidecar/sds.py), and
the control plane, whose listeners and clusters refer to them (xds_server/resources/tls.py)."""

SDS_CLUSTER = "meshlm_sds"  # the sidecar's bootstrap cluster to its identity agent's socket
DEFAULT = "default"  # tls_certificate: the workload's chain and key (Istio's name)
ROOTCA = "ROOTCA"  # validation_context: the mesh's trust bundle (Istio's name)
