"""GPU pod attribution from a real gRPC server speaking the kubelet PodResources v1 List call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError

from megatrace.exporters.podresources import gpu_owners, pod_lookup
from tests.support.kubelet import kubelet, list_response, message, pod


def response() -> bytes:
    other = message(
        (1, "inference-0"),
        (2, "serve"),
        (3, message((1, "server"), (2, message((1, "nvidia.com/gpu"), (2, "GPU-cccc"))))),
    )
    return list_response(pod("ml-train", "llama-70b-worker-3", "trainer", ["GPU-aaaa", "GPU-bbbb"]), other)


@pytest.fixture
def kubelet_socket(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    socket = tmp_path / "kubelet.sock"
    with kubelet(socket, response()) as requests:
        yield socket, requests


def test_gpus_map_to_their_pods(kubelet_socket: tuple[Path, list[bytes]]) -> None:
    socket, requests = kubelet_socket
    owners = pod_lookup(socket)()
    assert owners == {
        "GPU-aaaa": ("ml-train", "llama-70b-worker-3", "trainer"),
        "GPU-bbbb": ("ml-train", "llama-70b-worker-3", "trainer"),
        "GPU-cccc": ("serve", "inference-0", "server"),
    }
    assert requests == [b""]  # an empty ListPodResourcesRequest


def test_absent_socket_means_no_attribution(tmp_path: Path) -> None:
    assert pod_lookup(tmp_path / "no.sock")() == {}


def test_socket_nobody_answers_means_no_attribution(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"
    dead.write_text("")
    assert pod_lookup(dead, timeout=2.0)() == {}


def test_truncated_messages_are_refused() -> None:
    with pytest.raises(DecodeError):
        gpu_owners(response()[:-3])
    with pytest.raises(DecodeError):
        gpu_owners(b"\x0a\x05ab")


def test_a_kubelet_answering_garbage_means_no_attribution(tmp_path: Path) -> None:
    with kubelet(tmp_path / "k.sock", b"\x0a\x05ab"):
        assert pod_lookup(tmp_path / "k.sock")() == {}
