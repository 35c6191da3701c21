"""The rollout gates, one module per source: the caller sidecars' gRPC counters
(`envoy_stats`), the canary runtimes' latency histograms (`runtime_metrics`), a Prometheus
server's queries (`prometheus`, rendered by `promql`). `direct` judges an interval on the first
two, `fetch` is how every source is read, `sources` what the controller reads for one rollout."""
