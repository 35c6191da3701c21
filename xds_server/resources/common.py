"""Small proto helpers shared by the builders."""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, config_source_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def u32(v: int) -> wrappers_pb2.UInt32Value:
    return wrappers_pb2.UInt32Value(value=v)


def pack(msg: Message) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def ads() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )


def socket_address(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
    )
