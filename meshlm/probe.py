"""`python -m meshlm.probe URL`: exit 0 when GET URL answers 200, else 1 with the reason.

For Kubernetes exec probes (deploy/kubernetes/): the control plane's admin API and Envoy's
admin listen on loopback only, which kubelet's httpGet probes cannot reach, so the probe runs
inside the container. An https URL is not verified: on loopback there is no one to impersonate,
and the probe has no trust bundle. Only the standard library, so a probe starts fast.
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT = 3.0  # seconds; under the probes' timeoutSeconds


def probe(url: str, timeout: float = TIMEOUT) -> tuple[bool, str]:
    """(answered 200, the first line of the body or why not)."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status == 200, r.read(2000).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return False, f"{e.code}: {e.read(2000).decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


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
