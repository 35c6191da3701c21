"""The proxy-wasm filters (authz, request classes) in Zig and their build, the policy model,
their Envoy config, and a wasmtime host that runs them in Python (`meshlm policy test`)."""
