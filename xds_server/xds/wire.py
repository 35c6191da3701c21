"""Discovery responses serialized once and shared by every stream that is sent the same bytes.

A response's bytes differ between streams only by the nonce, so a response is serialized once
without it and each stream appends its own nonce field: protobuf parsers accept fields in any
order, and a field that appears once is the same wherever it stands (protobuf encoding,
"Field Order").
"""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

# The same field number in both responses, so one helper serves both variants of ADS.
(_NONCE,) = {
    r.DESCRIPTOR.fields_by_name["nonce"].number
    for r in (discovery_pb2.DiscoveryResponse, discovery_pb2.DeltaDiscoveryResponse)
}
_NONCE_TAG = bytes([_NONCE << 3 | 2])  # wire type 2: length-delimited


def with_nonce(body: bytes, nonce: str) -> bytes:
    """`body` (a response serialized without a nonce) with `nonce` set."""
    raw = nonce.encode()
    return body + _NONCE_TAG + _varint(len(raw)) + raw


def serialize(response: Message | bytes) -> bytes:
    """The ADS methods' response serializer: shared bytes go out as they are."""
    if type(response) is bytes:
        return response
    return response.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
