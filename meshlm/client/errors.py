"""The errors of the Python client (meshlm.client): one class per gRPC status a caller of the
mesh handles differently, all of them grpc.RpcError (code(), details(), trailing_metadata()), so
code written against plain grpc keeps working.

    try:
        text = llm.chat([{"role": "user", "content": "Hi"}]).text
    except RateLimited:      # the tenant's rate limit, or the runtime's queue is full
        ...
    except Unavailable:      # no healthy replica (StreamLost: a stream's resumes ran out)
        ...
    except MeshlmError as e: # anything else, e.code() says which
        ...
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "MeshlmError",
    "NoRoute",
    "PermissionDenied",
    "RateLimited",
    "StreamLost",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
]


class MeshlmError(grpc.RpcError):
    """A call failed; code() is its gRPC status, details() the reason the server gave."""

    CODE = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        self._code = code or self.CODE
        self._details = details
        self._trailers = tuple(trailing_metadata)
        super().__init__(f"{self._code.name}: {details}" if details else self._code.name)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers


class Unauthenticated(MeshlmError):
    """No API key, or one the sidecar does not know (UNAUTHENTICATED)."""

    CODE = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshlmError):
    """The key's tenant may not call this service or method (PERMISSION_DENIED)."""

    CODE = grpc.StatusCode.PERMISSION_DENIED


class RateLimited(MeshlmError):
    """The tenant's rate limit, or a runtime's full queue shedding load (RESOURCE_EXHAUSTED);
    worth retrying later."""

    CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(MeshlmError):
    """No replica could serve the call (UNAVAILABLE): all down, ejected or still loading."""

    CODE = grpc.StatusCode.UNAVAILABLE


class StreamLost(Unavailable):
    """A stream failed again after `max_resumes` resumes (UNAVAILABLE), with why."""


class InvalidArgument(MeshlmError, ValueError):
    """The request is malformed, found here before sending or by the runtime (INVALID_ARGUMENT);
    the message names the field. Also a ValueError."""

    CODE = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(MeshlmError):
    """The call's `timeout` passed (DEADLINE_EXCEEDED); a stream is never resumed after it."""

    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


class NoRoute(MeshlmError):
    """Nothing answers this call here (UNIMPLEMENTED): through a sidecar, the authority is not a
    service of the mesh; or the target is not a meshlm runtime or sidecar."""

    CODE = grpc.StatusCode.UNIMPLEMENTED


class Cancelled(MeshlmError):
    """The call was cancelled (CANCELLED), by the server or the path, not by this client."""

    CODE = grpc.StatusCode.CANCELLED


class InternalError(MeshlmError):
    """The server failed (INTERNAL, UNKNOWN, DATA_LOSS)."""

    CODE = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[MeshlmError]] = {
    cls.CODE: cls
    for cls in (
        Unauthenticated,
        PermissionDenied,
        RateLimited,
        Unavailable,
        InvalidArgument,
        DeadlineExceeded,
        NoRoute,
        Cancelled,
        InternalError,
    )
}
_BY_CODE[grpc.StatusCode.UNKNOWN] = InternalError
_BY_CODE[grpc.StatusCode.DATA_LOSS] = InternalError


def from_rpc_error(e: grpc.RpcError) -> MeshlmError:
    """The typed error of a failed call (grpc or grpc.aio); a MeshlmError as it is."""
    if isinstance(e, MeshlmError):
        return e
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (e.details() if callable(getattr(e, "details", None)) else None) or ""
    trailers = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else ()
    cls = _BY_CODE.get(code, MeshlmError)
    return cls(details, code=code, trailing_metadata=tuple(trailers or ()))
