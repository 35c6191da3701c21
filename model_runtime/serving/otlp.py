"""OTLP export of the runtime's traces and metrics when `OTEL_EXPORTER_OTLP_ENDPOINT` (or a
per-signal `OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT`) is set, as every OpenTelemetry user
expects. The exporters read the standard variables themselves (headers, timeout, compression,
`OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`).

Protocol http/protobuf only (the specification's default; collectors listen on 4318): the gRPC
exporter needs googleapis-common-protos, whose google.api/google.rpc modules collide with the
copies xds-protos ships (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

PROTOCOL = "http/protobuf"


class OtlpConfigError(ValueError):
    """An OTEL_* variable this runtime cannot honour (named in the message)."""


def _wanted(environ: Mapping[str, str], signal: str) -> bool:
    return bool(
        environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def providers(
    environ: Mapping[str, str],
) -> tuple[TracerProvider | None, MeterProvider | None]:
    """SDK providers exporting over OTLP for the signals the environment asks for (None for a
    signal it does not)."""
    traces, metrics = _wanted(environ, "TRACES"), _wanted(environ, "METRICS")
    if not (traces or metrics):
        return None, None
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):  # fmt: skip
        if environ.get(var, PROTOCOL) != PROTOCOL:
            raise OtlpConfigError(
                f"{var}={environ[var]}: meshlm exports OTLP over {PROTOCOL} only; point "
                "OTEL_EXPORTER_OTLP_ENDPOINT at the collector's OTLP/HTTP port (4318)"
            )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    attrs = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "meshlm-runtime"}
    resource = Resource.create(attrs)
    tracer = meter = None
    if traces:
        tracer = TracerProvider(resource=resource)
        tracer.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if metrics:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        meter = MeterProvider(resource=resource, metric_readers=[reader])
    return tracer, meter
