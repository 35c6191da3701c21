"""The `stall` block of the mesh file (issue 10): strict parsing, the header that carries it to
callers, and what it adds to the caller-side route (Envoy's per-try idle timeout, previous_hosts,
the version a resume pins)."""

from __future__ import annotations

import pytest

from mesh_common.headers import STALL_HEADER, VERSION_HEADER
from xds_server.mesh import MeshError, Stall, parse_mesh
from xds_server.resources.routes import outbound_route_config


def _mesh(stall: object = None, weights: dict | None = None) -> dict:
    versions = {v: {"endpoints": [f"127.0.0.1:{50051 + i}"]} for i, v in enumerate("abc")}
    svc = {"versions": versions, "route": {"weights": weights or {"a": 90, "b": 10, "c": 0}}}
    if stall is not None:
        svc["stall"] = stall
    rollout = {"stable": "a", "canary": "b", "steps": [50, 100]}
    return {"services": {"llm": svc}, "rollouts": {"llm": rollout}}


def test_stall_block_defaults_and_values() -> None:
    assert parse_mesh(_mesh({})).services["llm"].stall == Stall()
    s = parse_mesh(_mesh({"gap": "250ms", "consecutive": 2, "hard_limit": "4s", "max_resumes": 1}))
    assert s.services["llm"].stall == Stall(gap=0.25, consecutive=2, hard_limit=4.0, max_resumes=1)
    assert parse_mesh(_mesh()).services["llm"].stall is None


@pytest.mark.parametrize(
    ("stall", "message"),
    [
        ({"gap": "1s", "hard_limit": "1s"}, "services.llm.stall.hard_limit: must be more than gap"),
        ({"gaps": "1s"}, "services.llm.stall.gaps: unknown field"),
        ({"consecutive": 0}, "services.llm.stall.consecutive: 0 out of range"),
        ({"max_resumes": -1}, "services.llm.stall.max_resumes: -1 out of range"),
        ({"max_resumes": True}, "services.llm.stall.max_resumes: expected an integer"),
        ({"gap": "soon"}, "services.llm.stall.gap: expected a duration"),
        ({"gap": "0s"}, "services.llm.stall.gap: must be greater than 0"),
        ("3s", "services.llm.stall: expected a mapping"),
    ],
)
def test_bad_stall_block_names_the_field(stall: object, message: str) -> None:
    with pytest.raises(MeshError, match="^" + message.replace(".", r"\.")):
        parse_mesh(_mesh(stall))


def test_stall_header_round_trip_and_bad_values() -> None:
    s = Stall(gap=0.5, consecutive=4, hard_limit=2.5, max_resumes=3)
    assert Stall.from_header(s.header_value()) == s
    for bad in ("", "gap_ms=500", "gap_ms=x;consecutive=1;hard_limit_ms=2;max_resumes=1",
                "gap_ms=500;consecutive=3;hard_limit_ms=100;max_resumes=1"):  # fmt: skip
        with pytest.raises(ValueError, match=STALL_HEADER):
            Stall.from_header(bad)


def _routes(mesh: dict) -> tuple[list, object]:
    """The service's routes after the first, which refuses clients' ORCA calls."""
    vhost = outbound_route_config(parse_mesh(mesh)).virtual_hosts[0]
    assert vhost.routes[0].name == "llm-orca-refused"
    return list(vhost.routes)[1:], vhost


def test_route_with_stall_block() -> None:
    routes, vhost = _routes(_mesh({"gap": "500ms", "hard_limit": "3s", "max_resumes": 1}))
    stall_header = [h.header for h in vhost.response_headers_to_add]
    assert [(h.key, h.value) for h in stall_header] == [
        (STALL_HEADER, "gap_ms=500;consecutive=3;hard_limit_ms=3000;max_resumes=1")
    ]
    # A resume pins the version that served it, only among versions the caller reaches anyway:
    # c has weight 0 and is neither the stable nor the canary.
    pins = [r for r in routes if r.name.startswith("llm-resume-")]
    assert [(r.name, r.match.headers[0].name, r.route.cluster) for r in pins] == [
        ("llm-resume-a", VERSION_HEADER, "outbound|llm|a"),
        ("llm-resume-b", VERSION_HEADER, "outbound|llm|b"),
    ]
    assert routes[: len(pins)] == pins  # before the x-canary pins and the split
    # The OpenAI HTTP API's routes (issue 17) get no per-try limits: a completion without
    # `stream` is silent until its whole answer (tests/test_openai_mesh.py).
    openai = [r for r in routes if r.name.endswith("-openai")]
    assert [r.match.prefix for r in openai] == ["/v1/"] * 3
    assert not any(r.route.retry_policy.HasField("per_try_idle_timeout") for r in openai)
    for r in routes:
        if r in openai:
            continue
        rp = r.route.retry_policy
        assert rp.per_try_idle_timeout.seconds == 3
        assert {"reset", "unavailable"} <= set(rp.retry_on.split(","))
        assert [p.name for p in rp.retry_host_predicate] == [
            "envoy.retry_host_predicates.previous_hosts"
        ]
    # Each response says which version served it.
    weighted = routes[-1].route.weighted_clusters.clusters
    assert {c.name: [h.header.value for h in c.response_headers_to_add] for c in weighted} == {
        "outbound|llm|a": ["a"],
        "outbound|llm|b": ["b"],
        "outbound|llm|c": ["c"],
    }


def test_route_without_stall_block_is_unchanged() -> None:
    routes, vhost = _routes(_mesh())
    assert not vhost.response_headers_to_add
    assert not any(r.name.startswith("llm-resume-") for r in routes)
    assert not any(r.route.retry_policy.HasField("per_try_idle_timeout") for r in routes)
    assert not any(c.response_headers_to_add for c in routes[-1].route.weighted_clusters.clusters)


def test_failure_percentage_outlier_detection() -> None:
    """A replica that stalls gRPC streams after their headers records a 200 and then a timeout
    per stream, so only its failure percentage can eject it (consecutive counters reset)."""
    from xds_server.resources.clusters import outlier_detection

    raw = _mesh()
    raw["services"]["llm"]["outlier_detection"] = {
        "failure_percentage_threshold": 30,
        "failure_percentage_request_volume": 5,
    }
    od = outlier_detection(parse_mesh(raw).services["llm"].outlier_detection)
    assert (od.failure_percentage_threshold.value, od.enforcing_failure_percentage.value) == (
        30,
        100,
    )
    assert od.failure_percentage_minimum_hosts.value == 2
    assert od.failure_percentage_request_volume.value == 5
    raw["services"]["llm"]["outlier_detection"] = {"failure_percentage_threshold": 0}
    with pytest.raises(
        MeshError,
        match=r"^services\.llm\.outlier_detection\.failure_percentage_threshold: 0 out of range",
    ):
        parse_mesh(raw)
