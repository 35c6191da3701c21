"""The shipped authz.wasm: its proxy-wasm ABI surface, and that it is the build of its source."""

from __future__ import annotations

import wasmtime

from wasm_filters import build
from wasm_filters.host import _IMPORTS

ABI_EXPORTS = {
    "proxy_abi_version_0_2_1",
    "proxy_on_memory_allocate",
    "proxy_on_vm_start",
    "proxy_on_context_create",
    "proxy_on_configure",
    "proxy_on_request_headers",
    "proxy_on_delete",
    "memory",
}


def test_module_speaks_proxy_wasm_0_2_1_and_imports_only_known_host_calls() -> None:
    module = wasmtime.Module.from_file(wasmtime.Engine(), str(build.WASM))
    exports = {e.name for e in module.exports}
    assert exports >= ABI_EXPORTS
    imports = {(i.module, i.name) for i in module.imports}
    assert imports <= {("env", name) for name, _, _ in _IMPORTS}
    assert build.WASM.stat().st_size < 200_000
