"""The caller library's resume decision (meshlm/client/core.py, I/O-free) for a stream that
breaks before its first token: resumed once a replica took it (its response headers came; a
host cut off right after them is reset by the caller-side Envoy's idle timeout, which retries
no stream past its headers), a typed error when no replica answered (the route's own retry
had its turn). The same decision on real processes: tests/test_caller_resume.py and the
multi-host demo's partition."""

from __future__ import annotations

import grpc
import pytest

from mesh_common.headers import REPLICA_HEADER
from meshlm.client.core import CallerBase, Ended
from meshlm.client.errors import InternalError
from xds_server.mesh import Stall


class _Reset(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "Stream removed (RST_STREAM)"


def _progress():
    caller = CallerBase(Stall(max_resumes=2), [])
    p = caller.progress("hi", None, None, {"max_new_tokens": 4}, timeout=30, metadata=(),
                        mirror=False)  # fmt: skip
    p.attempt()
    return caller, p


def test_a_stream_reset_after_a_replicas_headers_is_resumed_with_nothing_delivered() -> None:
    caller, p = _progress()
    assert p.event("headers", {REPLICA_HEADER: "r1"}, 0.0) is None
    ended = p.event("error", _Reset(grpc.StatusCode.INTERNAL), 0.0)
    assert isinstance(ended, Ended) and ended.failure.startswith("INTERNAL")
    p.failed(ended.failure, {REPLICA_HEADER: "r1"})
    assert [(r.replica, r.delivered) for r in p.resumes] == [("r1", 0)]
    assert caller.resumes == 1


def test_a_failure_before_any_replica_answered_is_a_typed_error() -> None:
    _, p = _progress()
    with pytest.raises(InternalError):
        p.event("error", _Reset(grpc.StatusCode.INTERNAL), 0.0)


def test_a_request_error_after_the_headers_is_not_resumed() -> None:
    _, p = _progress()
    p.event("headers", {REPLICA_HEADER: "r1"}, 0.0)
    with pytest.raises(grpc.RpcError):
        p.event("error", _Reset(grpc.StatusCode.INVALID_ARGUMENT), 0.0)
