"""The class filter (classify.wasm) as Envoy configuration, for caller-side listeners. Besides
the class it sets the prefix key (`x-meshlm-prefix`, prefix.zig) that `prefix_aware` routes hash.

Inline in LDS, not ECDS: its configuration is a constant of the control plane's version (the
module and two sizes, nothing from the mesh file), so an unchanged listener is not updated and
drains nothing, and the listener does not wait on a second resource to serve. Unlike authz it
fails open: the filter labels requests, it does not guard them. Measured on Envoy 1.40 with a
module made to trap: under FAIL_OPEN the call that was inside the VM fails (UNAVAILABLE) and later
calls pass unclassified; FAIL_RELOAD failed the later calls too (reload backoff), FAIL_CLOSED all
of them. A failed VM sets no header, and the listener strips client-sent class headers itself
(an early header mutation), so no spoofed class gets through either.
`allow_on_headers_stop_iteration` lets the filter hold the headers (and route selection) until
the body says the class; without it Envoy turns that StopIteration into
StopAllIterationAndWatermark and Generate calls hang.
"""

from __future__ import annotations

import json
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as wasm_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import wrappers_pb2

from wasm_filters.xds import pack

CLASSIFY_WASM = Path(__file__).resolve().parent / "classify.wasm"
CLASSIFY_FILTER = "meshlm.classify"
VM_ID = "meshlm_classify"
PREFIX_BYTES = 64  # bytes of normalised text that make a class (see classify.zig)
# Above the runtime's 256 KiB prompt limit: any prompt it serves is classified whole; a larger
# first frame (many long messages) is classified by this prefix.
MAX_BODY_BYTES = 320 * 1024
# The prefix key: blocks of BLOCK_BYTES (about one 16-token KV block of text), the first
# PREFIX_BLOCKS of them (1 KiB of prompt; see prefix.zig for why a fixed leading window).
BLOCK_BYTES = 64
PREFIX_BLOCKS = 16


def classify_filter_config(
    *,
    prefix_bytes: int = PREFIX_BYTES,
    max_body_bytes: int = MAX_BODY_BYTES,
    block_bytes: int = BLOCK_BYTES,
    prefix_blocks: int = PREFIX_BLOCKS,
    name: str = CLASSIFY_FILTER,
) -> wasm_filter_pb2.Wasm:
    """`envoy.filters.http.wasm` config: V8, the module inline, failing open."""
    if not 1 <= prefix_bytes <= 4096:
        raise ValueError(f"prefix_bytes: {prefix_bytes} is outside 1..4096")
    if not 64 <= max_body_bytes <= 512 * 1024:
        raise ValueError(f"max_body_bytes: {max_body_bytes} is outside 64..524288")
    if not 1 <= block_bytes <= 4096:
        raise ValueError(f"block_bytes: {block_bytes} is outside 1..4096")
    if not 1 <= prefix_blocks <= 1024:
        raise ValueError(f"prefix_blocks: {prefix_blocks} is outside 1..1024")
    settings = json.dumps(
        {
            "prefix_bytes": prefix_bytes,
            "max_body_bytes": max_body_bytes,
            "block_bytes": block_bytes,
            "prefix_blocks": prefix_blocks,
        }
    )
    plugin = wasm_pb2.PluginConfig(
        name=name,
        root_id=VM_ID,
        vm_config=wasm_pb2.VmConfig(
            vm_id=VM_ID,
            runtime="envoy.wasm.runtime.v8",
            code=base_pb2.AsyncDataSource(
                local=base_pb2.DataSource(inline_bytes=CLASSIFY_WASM.read_bytes())
            ),
        ),
        configuration=pack(wrappers_pb2.StringValue(value=settings)),
        failure_policy=wasm_pb2.FAIL_OPEN,
        allow_on_headers_stop_iteration=wrappers_pb2.BoolValue(value=True),
    )
    return wasm_filter_pb2.Wasm(config=plugin)


def classify_http_filter(*, name: str = CLASSIFY_FILTER, **settings: int) -> hcm_pb2.HttpFilter:
    """The filter inline in a listener (static bootstraps, tests, benchmarks)."""
    return hcm_pb2.HttpFilter(
        name=name, typed_config=pack(classify_filter_config(name=name, **settings))
    )
