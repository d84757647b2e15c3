"""Which Kubernetes pod holds which GPU, from the kubelet PodResources API (v1 ``List``).

The kubelet serves gRPC on a unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``). The
response is decoded straight from the protobuf wire format (fields of ``ListPodResourcesResponse``,
``PodResources``, ``ContainerResources`` and ``ContainerDevices`` by number), so no generated code is
needed. When the socket is absent or the call fails, there is simply no attribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCE = "nvidia.com/gpu"

# Field numbers in k8s.io/kubelet/pkg/apis/podresources/v1/api.proto.
RESPONSE_POD_RESOURCES = 1
POD_NAME, POD_NAMESPACE, POD_CONTAINERS = 1, 2, 3
CONTAINER_NAME, CONTAINER_DEVICES = 1, 2
DEVICES_RESOURCE_NAME, DEVICES_IDS = 1, 2

WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a valid protobuf message."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field in a message; length-delimited values are bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == WIRE_VARINT:
            value, pos = _varint(buf, pos)
            yield number, value
        elif wire == WIRE_LEN:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise WireError("truncated field")
            yield number, buf[pos : pos + length]
            pos += length
        elif wire in (WIRE_I64, WIRE_I32):
            pos += 8 if wire == WIRE_I64 else 4
        else:
            raise WireError(f"unsupported wire type {wire}")


def _text(value: int | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else ""


def gpu_owners(response: bytes) -> dict[str, tuple[str, str, str]]:
    """Device id (GPU UUID) -> (namespace, pod, container) from a ListPodResourcesResponse."""
    owners: dict[str, tuple[str, str, str]] = {}
    for number, pod in fields(response):
        if number != RESPONSE_POD_RESOURCES or not isinstance(pod, bytes):
            continue
        pod_fields = list(fields(pod))
        name = next((_text(v) for n, v in pod_fields if n == POD_NAME), "")
        namespace = next((_text(v) for n, v in pod_fields if n == POD_NAMESPACE), "")
        for container in (v for n, v in pod_fields if n == POD_CONTAINERS and isinstance(v, bytes)):
            container_fields = list(fields(container))
            container_name = next((_text(v) for n, v in container_fields if n == CONTAINER_NAME), "")
            for devices in (
                v for n, v in container_fields if n == CONTAINER_DEVICES and isinstance(v, bytes)
            ):
                device_fields = list(fields(devices))
                resource = next((_text(v) for n, v in device_fields if n == DEVICES_RESOURCE_NAME), "")
                if resource != GPU_RESOURCE:
                    continue
                for number_, device_id in device_fields:
                    if number_ == DEVICES_IDS:
                        owners[_text(device_id)] = (namespace, name, container_name)
    return owners


def pod_lookup(socket_path: Path, timeout: float = 2.0) -> Callable[[], dict[str, tuple[str, str, str]]]:
    """A function returning the GPU owners now; empty while the socket is absent or the call fails."""

    def lookup() -> dict[str, tuple[str, str, str]]:
        if not socket_path.exists():
            return {}
        import grpc

        try:
            with grpc.insecure_channel(f"unix://{socket_path}") as channel:
                call = channel.unary_unary(LIST_METHOD)
                return gpu_owners(call(b"", timeout=timeout))
        except (grpc.RpcError, ValueError) as exc:
            log.warning("kubelet PodResources at %s: %s", socket_path, exc)
            return {}

    return lookup
