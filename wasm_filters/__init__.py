"""The proxy-wasm authz filter, its build, the policy model, and a wasmtime host for tests."""
