"""The one way a gate reads a measurement over HTTP: `get_json`, http(s) only, no redirects, no
proxy from the environment, a size cap and a deadline, so a source named in the mesh file can
neither lead the control plane elsewhere nor hold it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from xds_server.mesh.source_url import url_problem


class MeasurementError(RuntimeError):
    """A source could not be read (unreachable sidecar, bad JSON)."""


class HttpStatusError(MeasurementError):
    """A source answered an HTTP error status; `body` is the start of its answer."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


MAX_BODY = 4 * 2**20  # a filtered Envoy /stats or a runtime's /metrics.json is a few KB


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A source that redirects is refused: a redirect could lead to any other URL or scheme."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[override]
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl!r} not followed", headers, fp
        )


# http and https only (no file:, ftp:, data: handlers), no proxy from the environment.
_OPENER = urllib.request.OpenerDirector()
for _h in (
    urllib.request.ProxyHandler({}),
    urllib.request.HTTPHandler(),
    urllib.request.HTTPSHandler(),
    urllib.request.HTTPDefaultErrorHandler(),
    _NoRedirect(),
    urllib.request.HTTPErrorProcessor(),
):
    _OPENER.add_handler(_h)


def get_json(url: str, timeout: float) -> Any:
    """GET a source URL: http(s) only, no redirects, at most MAX_BODY bytes within `timeout`
    seconds in all (a slow trickle does not hold the controller)."""
    problem = url_problem(url)
    if problem:
        raise MeasurementError(f"source refused: {problem}")
    deadline = time.monotonic() + timeout
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            body = bytearray()
            while chunk := r.read(65536):
                body += chunk
                if len(body) > MAX_BODY:
                    raise MeasurementError(f"{url}: response over {MAX_BODY} bytes")
                if time.monotonic() > deadline:
                    raise MeasurementError(f"{url}: no complete response within {timeout:g}s")
        if body.startswith(b"# HELP") or body.startswith(b"# TYPE"):
            # A runtime's /metrics is Prometheus text; its JSON is at /metrics.json.
            raise MeasurementError(
                f"{url}: answered Prometheus text, not JSON (a runtime's JSON is at /metrics.json)"
            )
        return json.loads(body)
    except urllib.error.HTTPError as e:  # its body says why (Prometheus: a JSON error)
        why = e.read(1000).decode("utf-8", "replace").strip() if e.fp else ""
        raise HttpStatusError(f"{url}: {e}{': ' + why if why else ''}", e.code, why) from e
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise MeasurementError(f"{url}: {e}") from e
