"""Envoy's overload manager for a sidecar: shed load before the kernel OOM-kills Envoy."""

from __future__ import annotations

from typing import Any

_FIXED_HEAP = "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig"
_DOWNSTREAM = (
    "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)


def _action(name: str, saturation: float) -> dict[str, Any]:
    return {
        "name": name,
        "triggers": [
            {"name": "envoy.resource_monitors.fixed_heap", "threshold": {"value": saturation}}
        ],
    }


def overload_manager(max_heap_bytes: int = 256 * 2**20, max_connections: int = 10_000) -> dict:
    """Heap pressure (the `fixed_heap` monitor) first shrinks the heap, then stops new
    requests (503 / UNAVAILABLE, retryable elsewhere) rather than letting Envoy be killed."""
    if max_heap_bytes < 16 * 2**20:
        raise ValueError("max_heap_bytes: at least 16 MiB (Envoy itself needs about 10)")
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.fixed_heap",
                "typed_config": {
                    "@type": "type.googleapis.com/" + _FIXED_HEAP,
                    "max_heap_size_bytes": max_heap_bytes,
                },
            },
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/" + _DOWNSTREAM,
                    "max_active_downstream_connections": max_connections,
                },
            },
        ],
        "actions": [
            _action("envoy.overload_actions.shrink_heap", 0.90),
            _action("envoy.overload_actions.disable_http_keepalive", 0.92),
            _action("envoy.overload_actions.stop_accepting_requests", 0.95),
        ],
    }


def with_overload_manager(bootstrap: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    bootstrap["overload_manager"] = overload_manager(**kwargs)
    return bootstrap
