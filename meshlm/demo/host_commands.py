"""The command lines of one runtime host: a model runtime on the host's loopback and the sidecar
that fronts it and joins the service by registration.

The one place these argv lists are built: the multi-host demo runs them inside network
namespaces, and a Kubernetes pod (a runtime container and a sidecar container sharing the pod's
network) runs the same two lines. The runtime listens on 127.0.0.1 only; the sidecar's inbound
listener binds the host's own address, which it registers (`--register ADDRESS:INBOUND_PORT`)
once the runtime is SERVING, so no endpoint of the host is written in the mesh file. With
identity paths, the sidecar gets its SPIFFE certificate from the mesh CA (join token file) and
every hop, the registration stream included, is mTLS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    """A sidecar's workload identity files: its single-use join token (a 0600 file) and the
    private dir where its key and certificate are kept."""

    join_token_file: Path
    identity_dir: Path


@dataclass(frozen=True)
class HostCommands:
    runtime: list[str]
    sidecar: list[str]


def runtime_host_commands(
    address: str,
    *,
    xds: str,
    service: str,
    version: str,
    grpc_port: int,
    http_port: int,
    inbound_port: int,
    admin_port: int,
    zone: str | None = None,
    precision: str = "int4",
    identity: Identity | None = None,
    lkg_file: Path | None = None,
    launcher: Sequence[str] = ("meshlm",),
) -> HostCommands:
    """argv of the runtime (`meshlm serve` on 127.0.0.1:grpc_port/http_port, serving the model
    as `service`) and of its sidecar (`meshlm sidecar` with its inbound listener on
    `address:inbound_port`, registered as that address, config from the control plane at
    `xds`, HOST:PORT). The sidecar's node id is SERVICE-VERSION-ADDRESS and the runtime's replica
    id (x-meshlm-replica) ADDRESS:INBOUND_PORT, both unique per host. `launcher`: how `meshlm` is
    run (e.g. `python -m meshlm.cli`)."""
    runtime = [
        *launcher, "serve", "--precision", precision,
        "--host", "127.0.0.1", "--port", str(grpc_port),
        "--http-port", str(http_port), "--served-model-name", service,
        "--replica-id", f"{address}:{inbound_port}",
    ]  # fmt: skip
    sidecar = [
        *launcher, "sidecar", "--xds", xds,
        "--node-id", f"{service}-{version}-{address}",
        "--service", service, "--version", version,
        "--listen-host", address, "--inbound-port", str(inbound_port),
        "--local-endpoint", f"127.0.0.1:{grpc_port}",
        "--local-http-endpoint", f"127.0.0.1:{http_port}",
        "--admin-port", str(admin_port),
        "--register", f"{address}:{inbound_port}",
    ]  # fmt: skip
    if zone:
        sidecar += ["--zone", zone]
    if lkg_file is not None:
        sidecar += ["--lkg-file", str(lkg_file)]
    if identity is not None:
        sidecar += [
            "--identity", "--join-token-file", str(identity.join_token_file),
            "--identity-dir", str(identity.identity_dir),
        ]  # fmt: skip
    return HostCommands(runtime=runtime, sidecar=sidecar)
