"""`python -m meshlm.probe URL`: exit 0 when URL is healthy, else 1 with the reason.

  http(s)://HOST:PORT/PATH   GET answers 200 (the control plane's /readyz, Envoy's /ready)
  grpc://HOST:PORT           grpc.health.v1 Check of the server ("") answers SERVING (a runtime)

For Kubernetes exec probes (deploy/kubernetes/): the control plane's admin API, Envoy's admin
and the runtime listen on loopback only, which kubelet's httpGet and grpc probes cannot reach,
so the probe runs inside the container. An https URL is not verified: on loopback there is no
one to impersonate, and the probe has no trust bundle. HTTP needs only the standard library.
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT = 3.0  # seconds; under the probes' timeoutSeconds


def probe(url: str, timeout: float = TIMEOUT) -> tuple[bool, str]:
    """(healthy, the start of the answer or why not)."""
    if url.startswith("grpc://"):
        return _grpc(url.removeprefix("grpc://"), timeout)
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status == 200, r.read(2000).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return False, f"{e.code}: {e.read(2000).decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def _grpc(target: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as e:
            return False, f"grpc://{target}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m meshlm.probe URL", file=sys.stderr)
        return 2
    ok, text = probe(argv[0])
    print(text.strip(), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
