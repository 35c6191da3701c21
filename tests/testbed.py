"""A real Envoy in front of tiny real upstreams, to check authz filters end to end.

An echo gRPC server (grpcio, generic handler: the reply is the request metadata as JSON), an
echo HTTP server (the reply is the request headers as JSON) and a static bootstrap whose one
listener runs the given HTTP filters and routes gRPC to the first upstream and everything else
to the second; ECDS from a file instead of a control plane.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from mesh_common.ports import free_port
from sidecar.bootstrap import static_cluster

HCM = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


class _EchoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reply

    def log_message(self, *args: object) -> None:  # quiet
        pass


class EchoHttpUpstream:
    """Plain HTTP/1.1 upstream on loopback that echoes the request headers as JSON."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoHandler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> EchoHttpUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class _EchoMetadata(grpc.GenericRpcHandler):
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            md: dict[str, str] = {}
            for k, v in context.invocation_metadata():
                md[k] = v if isinstance(v, str) else v.decode(errors="replace")
            md[":path"] = details.method
            md[":body-sha256"] = hashlib.sha256(request).hexdigest()
            if self.tag:
                md[":upstream"] = self.tag
            return json.dumps(md).encode()

        return grpc.unary_unary_rpc_method_handler(unary)


class EchoGrpcUpstream:
    """grpcio server on loopback: every method answers with the request metadata as JSON, plus
    `:path`, `:body-sha256` (of the request message as received) and `:upstream` (`tag`)."""

    def __init__(self, tag: str = "") -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((_EchoMetadata(tag),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> EchoGrpcUpstream:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)


def filter_dict(f: Any) -> dict[str, Any]:
    """An HttpFilter proto as bootstrap JSON."""
    return json_format.MessageToDict(f, preserving_proto_field_name=True)


def bootstrap(
    http_filters: list[Any],
    *,
    grpc_port: int,
    http_port: int,
    listener_port: int | None = None,
    exact_balance: bool = False,
    direct_response: bool = False,
) -> dict[str, Any]:
    """Static bootstrap: listener -> `http_filters` (protos or dicts) + router -> upstreams, or
    with `direct_response` a 200 "ok" from Envoy itself (the authz benchmark: Envoy and its
    filters alone, no upstream)."""
    port = listener_port or free_port()
    filters = [f if isinstance(f, dict) else filter_dict(f) for f in http_filters]

    def cluster(name: str, upstream_port: int, h2: bool) -> dict[str, Any]:
        return static_cluster(name, "127.0.0.1", upstream_port, http2=h2, connect_timeout="2s")

    grpc_match = {"name": "content-type", "string_match": {"prefix": "application/grpc"}}
    routes: list[dict[str, Any]] = [
        {"match": {"prefix": "/", "headers": [grpc_match]}, "route": {"cluster": "grpc_upstream"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "http_upstream"}},
    ]
    if direct_response:
        ok = {"status": 200, "body": {"inline_string": "ok"}}
        routes = [{"match": {"prefix": "/"}, "direct_response": ok}]
    listener: dict[str, Any] = {
        "name": "inbound",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": HCM,
                            "stat_prefix": "inbound",
                            "codec_type": "AUTO",
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": routes,
                                    }
                                ]
                            },
                            "http_filters": [*filters, ROUTER],
                        },
                    }
                ]
            }
        ],
    }
    if exact_balance:
        listener["connection_balance_config"] = {"exact_balance": {}}
    return {
        "node": {"id": "authz-testbed", "cluster": "authz-testbed"},
        "static_resources": {
            "listeners": [listener],
            "clusters": [
                cluster("grpc_upstream", grpc_port, True),
                cluster("http_upstream", http_port, False),
            ],
        },
    }


def listener_port(boot: dict[str, Any]) -> int:
    return boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]


def file_ecds_http_filter(path: str, *, name: str = "meshlm.authz") -> Any:
    """An ECDS filter fed from a file (Envoy's filesystem subscription) instead of ADS: the
    same update/ACK/NACK path inside Envoy, without a control plane."""
    from envoy.config.core.v3 import base_pb2, config_source_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    from mesh_common.type_urls import WASM as WASM_TYPE_URL

    source = config_source_pb2.ConfigSource(
        path_config_source=config_source_pb2.PathConfigSource(
            path=path, watched_directory=base_pb2.WatchedDirectory(path=str(Path(path).parent))
        ),
        resource_api_version=config_source_pb2.V3,
    )
    return hcm_pb2.HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=source, type_urls=[WASM_TYPE_URL]
        ),
    )


def write_ecds_file(path: str, ext_config: Any, version: str) -> None:
    """Atomically replace the file with a DiscoveryResponse holding `ext_config`."""
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf import any_pb2

    res = any_pb2.Any()
    res.Pack(ext_config)
    resp = discovery_pb2.DiscoveryResponse(version_info=version, resources=[res])
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(json_format.MessageToDict(resp)))
    tmp.rename(path)
