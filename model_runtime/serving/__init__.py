"""The runtime's surfaces: the gRPC service and its client, the OpenAI-compatible HTTP API, ORCA
load reports, metrics (Prometheus, OTLP), greedy-call records and injected faults."""
