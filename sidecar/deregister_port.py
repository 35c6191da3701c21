"""A loopback HTTP port where `POST /deregister` takes this sidecar's host out of its callers'
pools while the sidecar keeps serving: the runtime beside it can then drain with its inbound
listener still up. For a hook that runs before the runtime is stopped (a Kubernetes `preStop` on
the runtime container: kubelet stops a pod's main containers before its native sidecars, so the
sidecar's own SIGTERM comes after the runtime's drain).

Anyone on the host's loopback (in a pod: the pod's containers) can take the host out; nothing
else is served there. `python -m sidecar.deregister_port PORT` is the hook's client.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sidecar.registration import Registration

PATH = "/deregister"


class DeregisterPort:
    def __init__(self, port: int, registration: Registration, host: str = "127.0.0.1") -> None:
        self.registration = registration
        self._server = ThreadingHTTPServer((host, port), _handler(registration))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> DeregisterPort:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="deregister-port", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(timeout=5)


def _handler(registration: Registration) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != PATH:
                self._reply(404, {"error": f"no such endpoint: POST {self.path} (POST {PATH})"})
                return
            was = registration.registered
            left = registration.deregister()
            # left: the control plane answered that the callers hold the removal.
            self._reply(200, {"deregistered": left, "was_registered": was})

        def do_GET(self) -> None:
            self._reply(405, {"error": f"POST {PATH} takes this host out of its callers' pools"})

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the sidecar prints what deregistration did

    return Handler


def main(argv: list[str] | None = None) -> int:
    """`python -m sidecar.deregister_port PORT`: POST /deregister on 127.0.0.1:PORT; 0 once the
    sidecar answered (whether or not its host was registered), else 1 with the reason."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m sidecar.deregister_port PORT", file=sys.stderr)
        return 2
    url = f"http://127.0.0.1:{argv[0]}{PATH}"
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            print(r.read(2000).decode(errors="replace"))
            return 0
    except urllib.error.HTTPError as e:
        print(f"{url}: {e.code}: {e.read(2000).decode(errors='replace')}", file=sys.stderr)
    except OSError as e:
        print(f"{url}: {getattr(e, 'reason', e)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
