"""Which Kubernetes pod holds which GPU, from the kubelet PodResources API (v1 ``List``).

The kubelet serves gRPC on a unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``). The
messages are the ones of ``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto`` that ``List`` needs,
declared here as a protobuf file descriptor (the same field names and numbers) so that the protobuf
library encodes and decodes them without generated code; fields the kubelet adds are kept as unknown
fields and ignored. When the socket is absent or the call fails, there is simply no attribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from megatrace.exporters.collector_settings import setting

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCE = "nvidia.com/gpu"

# Device id (the GPU UUID for NVIDIA's device plugin) -> (namespace, pod, container).
PodLookup = Callable[[], dict[str, tuple[str, str, str]]]

_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_INT64 = descriptor_pb2.FieldDescriptorProto.TYPE_INT64
_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_ONE = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_MANY = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED

# message -> [(field name, number, label, type, message type name)], as in the kubelet's api.proto.
MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, _MANY, _MESSAGE, "PodResources")],
    "PodResources": [
        ("name", 1, _ONE, _STRING, ""),
        ("namespace", 2, _ONE, _STRING, ""),
        ("containers", 3, _MANY, _MESSAGE, "ContainerResources"),
    ],
    "ContainerResources": [
        ("name", 1, _ONE, _STRING, ""),
        ("devices", 2, _MANY, _MESSAGE, "ContainerDevices"),
        ("cpu_ids", 3, _MANY, _INT64, ""),
    ],
    "ContainerDevices": [
        ("resource_name", 1, _ONE, _STRING, ""),
        ("device_ids", 2, _MANY, _STRING, ""),
        ("topology", 3, _ONE, _MESSAGE, "TopologyInfo"),
    ],
    "TopologyInfo": [("nodes", 1, _MANY, _MESSAGE, "NUMANode")],
    "NUMANode": [("ID", 1, _ONE, _INT64, "")],
}


def _message_classes() -> dict[str, type]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="megatrace/podresources_v1.proto", package="v1", syntax="proto3"
    )
    for name, fields in MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            field = message.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                field.type_name = f".v1.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}")) for name in MESSAGES
    }


CLASSES = _message_classes()
ListPodResourcesRequest = CLASSES["ListPodResourcesRequest"]
ListPodResourcesResponse = CLASSES["ListPodResourcesResponse"]


def gpu_owners(response: bytes) -> dict[str, tuple[str, str, str]]:
    """Device id (GPU UUID) -> (namespace, pod, container) from a ListPodResourcesResponse's bytes;
    DecodeError when they are not one."""
    owners: dict[str, tuple[str, str, str]] = {}
    for pod in ListPodResourcesResponse.FromString(response).pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == GPU_RESOURCE:
                    for device_id in devices.device_ids:
                        owners[device_id] = (pod.namespace, pod.name, container.name)
    return owners


DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def socket_setting() -> Any:
    """The ``podresources_socket`` key, for the settings of every collector that attributes GPUs."""
    return setting(
        DEFAULT_SOCKET,
        'kubelet PodResources socket for GPU pod attribution ("" turns it off)',
        metavar="PATH",
    )


def configured_lookup(socket: str) -> PodLookup | None:
    """The pod lookup through the configured socket; None when attribution is off (``""``)."""
    return pod_lookup(Path(socket)) if socket else None


def pod_lookup(socket_path: Path, timeout: float = 2.0) -> PodLookup:
    """A function returning the GPU owners now; empty while the socket is absent or the call fails."""

    def lookup() -> dict[str, tuple[str, str, str]]:
        if not socket_path.exists():
            return {}
        import grpc

        try:
            with grpc.insecure_channel(f"unix://{socket_path}") as channel:
                call = channel.unary_unary(
                    LIST_METHOD, request_serializer=ListPodResourcesRequest.SerializeToString
                )
                return gpu_owners(call(ListPodResourcesRequest(), timeout=timeout))
        except (grpc.RpcError, DecodeError) as exc:
            log.warning("kubelet PodResources at %s: %s", socket_path, exc)
            return {}

    return lookup
