"""One Envoy next to one runtime: bootstrap, supervision, stats, last-known-good config, and the
workload identity agent with its SDS server."""
