"""The Prometheus metric provider's fields in a rollout's gates (issue 16 item 2): validated
with messages naming the field, kept through the rollout store, and the direct polling of
today stays the default when no provider is named."""

from __future__ import annotations

import pytest

from xds_server.mesh import MeshError, parse_mesh
from xds_server.mesh.rollout_spec import (
    MetricGate,
    PrometheusProvider,
    RolloutSpec,
    RolloutSpecError,
    parse_rollout,
)
from xds_server.rollout.gates.promql import QueryError, duration, render, single_value

RATE = (
    'sum(rate(envoy_cluster_grpc_Generate_success{envoy_cluster_name="{{ cluster }}"}'
    "[{{ interval }}]))"
)
GATES = {
    "provider": {"prometheus": {"url": "http://127.0.0.1:9090"}},
    "metrics": {
        "success_rate": {"query": RATE, "min": 0.99},
        "ttft_p99": {"query": 'ttft{version="{{ version }}"}', "max": "500ms"},
    },
}


def spec(gates: dict) -> RolloutSpec:
    return parse_rollout("llm", {"stable": "v1", "canary": "v2", "gates": gates})


def test_provider_gates_parse_and_survive_the_store_round_trip() -> None:
    s = spec(GATES)
    assert s.gates.provider == PrometheusProvider("http://127.0.0.1:9090", 5.0)
    assert s.gates.metrics == (
        MetricGate("success_rate", RATE, min=0.99),
        MetricGate("ttft_p99", 'ttft{version="{{ version }}"}', max=0.5),  # '500ms' -> seconds
    )
    assert RolloutSpec.from_dict(s.to_dict()) == s
    assert s.to_dict()["gates"]["metrics"]["ttft_p99"] == {
        "query": 'ttft{version="{{ version }}"}',
        "max": 0.5,
    }


def test_without_a_provider_the_direct_gates_stay_the_default() -> None:
    s = spec({})
    assert s.gates.provider is None and s.gates.metrics == ()
    assert s.gates.grpc_success_rate_min == 99.0 and s.gates.min_requests == 20
    assert RolloutSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("gates", "message"),
    [
        ({**GATES, "provider": {"datadog": {}}}, r"gates\.provider: expected \{prometheus"),
        (
            {**GATES, "provider": {"prometheus": {"url": "file:///etc/passwd"}}},
            r"gates\.provider\.prometheus\.url: only http and https",
        ),
        (
            {**GATES, "provider": {"prometheus": {"url": "http://u:p@h:9090"}}},
            r"gates\.provider\.prometheus\.url: credentials",
        ),
        (
            {**GATES, "provider": {"prometheus": {"url": "http://h", "tls": 1}}},
            r"gates\.provider\.prometheus\.tls: unknown field",
        ),
        (
            {**GATES, "provider": {"prometheus": {"url": "http://h", "timeout": "2m"}}},
            r"gates\.provider\.prometheus\.timeout: expected 0 < timeout <= 60s",
        ),
        ({"provider": GATES["provider"]}, r"gates\.metrics: expected a mapping of gate name"),
        ({"metrics": GATES["metrics"]}, r"gates\.provider: expected \{prometheus"),
        ({**GATES, "min_requests": 5}, r"gates\.min_requests: not read when gates\.provider"),
        (
            {**GATES, "metrics": {"sr": {"query": "up{x='{{ namespace }}'}", "min": 1}}},
            r"gates\.metrics\.sr\.query: unknown variable \{\{ namespace \}\} \(known: interval",
        ),
        ({**GATES, "metrics": {"sr": {"query": " ", "min": 1}}}, r"gates\.metrics\.sr\.query"),
        ({**GATES, "metrics": {"sr": {"query": "up"}}}, r"gates\.metrics\.sr: needs min, max"),
        (
            {**GATES, "metrics": {"sr": {"query": "up", "min": 2, "max": 1}}},
            r"gates\.metrics\.sr\.min: 2 is above max 1",
        ),
        (
            {**GATES, "metrics": {"sr": {"query": "up", "max": "fast"}}},
            r"gates\.metrics\.sr\.max: expected a number or a duration",
        ),
        (
            {**GATES, "metrics": {"sr": {"query": "up", "min": True}}},
            r"gates\.metrics\.sr\.min: expected a number",
        ),
        (
            {**GATES, "metrics": {"sr": {"query": "up", "threshold": 1}}},
            r"gates\.metrics\.sr\.threshold: unknown field",
        ),
    ],
)
def test_bad_provider_fields_are_refused_naming_the_field(gates: dict, message: str) -> None:
    with pytest.raises(RolloutSpecError, match=r"rollouts\.llm\." + message):
        spec(gates)


def test_the_mesh_file_validates_the_provider_fields() -> None:
    def mesh(gates: dict):
        return parse_mesh(
            {
                "services": {
                    "llm": {
                        "versions": {
                            "v1": {"endpoints": ["127.0.0.1:7001"]},
                            "v2": {"endpoints": ["127.0.0.1:7002"]},
                        },
                        "route": {"weights": {"v1": 100, "v2": 0}},
                    }
                },
                "rollouts": {
                    "llm": {"stable": "v1", "canary": "v2", "steps": [50], "gates": gates}
                },
            }
        )

    assert mesh(GATES).rollouts["llm"].gates["provider"] == GATES["provider"]
    with pytest.raises(MeshError, match=r"rollouts\.llm\.gates\.metrics\.ttft_p99\.max"):
        mesh({**GATES, "metrics": {"ttft_p99": {"query": "x", "max": "soon"}}})


def test_templates_and_answers() -> None:
    values = {"interval": duration(1.5), "cluster": "outbound|llm|v2"}
    assert render("rate(x{c='{{cluster}}'}[{{ interval }}])", values) == (
        "rate(x{c='outbound|llm|v2'}[1500ms])"
    )
    assert duration(10.0) == "10s"

    def vector(*values: str) -> dict:
        result = [{"metric": {"i": str(i)}, "value": [1.0, v]} for i, v in enumerate(values)]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    assert single_value(vector("0.995")) == 0.995
    assert single_value(vector()) is None  # no data holds
    assert single_value(vector("NaN")) is None  # 0/0: no calls in the window holds
    scalar = {"status": "success", "data": {"resultType": "scalar", "result": [1.0, "2"]}}
    assert single_value(scalar) == 2.0
    with pytest.raises(QueryError, match="2 series"):
        single_value(vector("1", "2"))
    with pytest.raises(QueryError, match="bad_data: parse error"):
        single_value({"status": "error", "errorType": "bad_data", "error": "parse error"})
