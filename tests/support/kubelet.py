"""A stand-in kubelet PodResources v1 server on a unix socket, for tests of pod attribution.

It speaks gRPC (``/v1.PodResourcesLister/List``) through grpcio and encodes its answer by hand from
field numbers of the kubelet's ``api.proto``, independently of the product's protobuf declarations,
so a wrong field number on either side shows as a failed test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def message(*parts: tuple[int, bytes | str | int]) -> bytes:
    """Encode a protobuf message from (field number, value) pairs: ints as varints, the rest as bytes."""
    out = bytearray()
    for number, value in parts:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            raw = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(raw)) + raw
    return bytes(out)


def pod(namespace: str, name: str, container: str, gpus: list[str], sidecar: bool = True) -> bytes:
    """A PodResources message: one container holding `gpus` (and a NIC, CPUs), plus a sidecar."""
    devices = message((1, "nvidia.com/gpu"), *((2, g) for g in gpus), (3, message((1, message((1, 0))))))
    nics = message((1, "rdma/hca_shared_devices_a"), (2, "mlx5_0"))
    trainer = message((1, container), (2, devices), (2, nics), (3, 4), (3, 5))
    parts: list[tuple[int, bytes | str | int]] = [(1, name), (2, namespace), (3, trainer)]
    if sidecar:
        parts.append((3, message((1, "log-shipper"))))
    return message(*parts)


def list_response(*pods: bytes) -> bytes:
    """A ListPodResourcesResponse holding `pods`."""
    return message(*((1, p) for p in pods))


@contextlib.contextmanager
def kubelet(socket: Path, response: bytes) -> Iterator[list[bytes]]:
    """Serve `response` to every List call on `socket`; yields the requests received."""
    requests: list[bytes] = []

    def list_call(request: bytes, context: grpc.ServicerContext) -> bytes:
        requests.append(request)
        return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(list_call)}
            ),
        )
    )
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield requests
    finally:
        server.stop(grace=None)
