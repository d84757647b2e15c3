"""GPU pod attribution from a real gRPC server speaking the kubelet PodResources v1 List call."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from megatrace.exporters.podresources import WireError, fields, gpu_owners, pod_lookup


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def message(*parts: tuple[int, bytes | str | int]) -> bytes:
    """Encode a protobuf message from (field number, value) pairs."""
    out = bytearray()
    for number, value in parts:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            raw = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(raw)) + raw
    return bytes(out)


def list_response() -> bytes:
    gpus = message(
        (1, "nvidia.com/gpu"), (2, "GPU-aaaa"), (2, "GPU-bbbb"), (3, message((1, message((1, 0)))))
    )
    nics = message((1, "rdma/hca_shared_devices_a"), (2, "mlx5_0"))
    trainer = message((1, "trainer"), (2, gpus), (2, nics), (3, 4), (3, 5))
    sidecar = message((1, "log-shipper"))
    pod = message((1, "llama-70b-worker-3"), (2, "ml-train"), (3, trainer), (3, sidecar))
    other = message(
        (1, "inference-0"),
        (2, "serve"),
        (3, message((1, "server"), (2, message((1, "nvidia.com/gpu"), (2, "GPU-cccc"))))),
    )
    return message((1, pod), (1, other))


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Path]:
    socket = tmp_path / "kubelet.sock"
    requests: list[bytes] = []

    def list_call(request: bytes, context: grpc.ServicerContext) -> bytes:
        requests.append(request)
        return list_response()

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
    yield socket
    server.stop(grace=None)


def test_gpus_map_to_their_pods(kubelet: Path) -> None:
    owners = pod_lookup(kubelet)()
    assert owners == {
        "GPU-aaaa": ("ml-train", "llama-70b-worker-3", "trainer"),
        "GPU-bbbb": ("ml-train", "llama-70b-worker-3", "trainer"),
        "GPU-cccc": ("serve", "inference-0", "server"),
    }


def test_absent_socket_means_no_attribution(tmp_path: Path) -> None:
    assert pod_lookup(tmp_path / "no.sock")() == {}


def test_socket_nobody_answers_means_no_attribution(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"
    dead.write_text("")
    assert pod_lookup(dead, timeout=2.0)() == {}


def test_truncated_messages_are_refused() -> None:
    with pytest.raises(WireError):
        gpu_owners(list_response()[:-3])
    with pytest.raises(WireError):
        list(fields(b"\x0a\x05ab"))
