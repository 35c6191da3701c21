"""What a URL that the control plane reads (a rollout gate's source) may be: http or https to a
named host, no credentials, no fragment. Checked when the mesh file is loaded and again before
every read, so no other scheme (file:, ftp:, data:) is ever opened."""

from __future__ import annotations

import urllib.parse
from typing import Any

SCHEMES = ("http", "https")


def url_problem(url: Any) -> str | None:
    """None for a usable source URL, else what is wrong with it."""
    if not isinstance(url, str) or not url:
        return f"expected an http(s) URL, got {url!r}"
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018 -- raises ValueError on a port out of range or not a number
    except ValueError as e:
        return f"not a valid URL {url!r}: {e}"
    if u.scheme not in SCHEMES:
        return f"only http and https URLs are read, got {u.scheme or 'no'} scheme in {url!r}"
    if not u.hostname:
        return f"no host in {url!r}"
    if u.username is not None or u.password is not None:
        return "credentials in a URL are not allowed (they would show in logs and status)"
    if u.fragment:
        return f"a fragment has no meaning here: {url!r}"
    return None
