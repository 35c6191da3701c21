"""One Envoy next to one runtime: bootstrap, supervision, stats, last-known-good config."""
