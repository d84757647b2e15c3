"""The trace endpoint: what it serves (windows the tracer's and analyzer's readers take as ring files)
and every refusal: wrong token, paths leading out of the root, oversized windows, unknown jobs."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from megatrace.analyzer.tracer_formats import read_ring_file
from megatrace.config import ConfigError
from megatrace.exporters.cli import build_collectors
from megatrace.exporters.settings import load
from megatrace.exporters.trace_endpoint import TraceEndpoint
from megatrace.exporters.trace_workers import SERVE_NICE
from megatrace.tracer.dumpfile import dump_path, write_dump
from megatrace.tracer.ringfile import read_ring
from megatrace.tracer.stack_fallback import read_stacks_file
from megatrace.tracer.stacks import main_stack
from tests.exporters.exposition import render, value
from tests.support import scenarios as S
from tests.support.services import free_port, running
from tests.support.stuck_rank import held_gil_stacks

TOKEN = "s3cret-trace-token"


@pytest.fixture(scope="module")
def trace_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with job "llm-7" (4 ranks of a simulated job, a stall dump of rank 1) and a secret
    folder beside the root that symlinks inside it point at."""
    base = tmp_path_factory.mktemp("endpoint")
    root = base / "traces"
    S.write_ring_files(S.simulate(S.Scenario(world=4, tp=2, steps=40)), root / "llm-7", job="llm-7")
    write_dump(dump_path(root / "llm-7", 1, 4242, 0), read_ring(root / "llm-7" / "rank-1.trace"), "stall")
    secret = base / "secret"
    secret.mkdir()
    (secret / "rank-0.trace").write_bytes((root / "llm-7" / "rank-0.trace").read_bytes())
    (secret / "rank-0.1.1.dump").write_text("private\n")
    (root / "escape").symlink_to(secret)
    (root / "llm-7" / "rank-9.1.1.dump").symlink_to(secret / "rank-0.1.1.dump")
    return root


@pytest.fixture
def endpoint(trace_root: Path, tmp_path: Path) -> Iterator[TraceEndpoint]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    served = TraceEndpoint(trace_root, ("127.0.0.1", 0), token, 100, 1 << 20, 2, node_name="gpu-node-7")
    yield served
    served.close()


def get(
    endpoint: TraceEndpoint, path: str, token: str | None = TOKEN, gzip_ok: bool = True
) -> tuple[int, bytes, dict[str, str]]:
    """GET `path` exactly as written (no client-side normalisation of '..' or %-escapes)."""
    conn = http.client.HTTPConnection(*endpoint.address[:2], timeout=30)
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    found = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    if found.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    return response.status, body, found


def test_lists_jobs_and_ranks_with_their_node(endpoint: TraceEndpoint) -> None:
    status, body, _ = get(endpoint, "/v1/jobs")
    assert status == 200
    assert json.loads(body) == {"node": "gpu-node-7", "jobs": ["escape", "llm-7"]}
    status, body, _ = get(endpoint, "/v1/jobs/llm-7")
    listing = json.loads(body)
    assert listing["node"] == "gpu-node-7"
    assert [r["rank"] for r in listing["ranks"]] == [0, 1, 2, 3]
    rank1 = listing["ranks"][1]
    assert rank1["dumps"] == ["rank-1.4242.0.dump"] and rank1["ring"] is True
    assert (rank1["world_size"], rank1["host"], rank1["local_rank"], rank1["gpu"]) == (4, "node0", 1, -1)
    # the dump symlinked from outside the root is not listed
    assert "rank-9.1.1.dump" not in json.dumps(listing)
    status, body, _ = get(endpoint, "/v1/jobs/llm-7/ranks/2")
    header = json.loads(body)
    assert (header["rank"], header["job"], header["world_size"]) == (2, "llm-7", 4)
    assert header["calls_by_op"]["all_reduce"] > 0


def test_ring_windows_are_ring_files_the_readers_accept(
    endpoint: TraceEndpoint, trace_root: Path, tmp_path: Path
) -> None:
    original = read_ring(trace_root / "llm-7" / "rank-3.trace")
    status, body, headers = get(endpoint, "/v1/jobs/llm-7/ranks/3/ring?last=50")
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert int(headers["content-length"]) < len(body) / 2  # compressed on the wire
    served = tmp_path / "window.trace"
    served.write_bytes(body)
    for snapshot in (read_ring(served), read_ring_file(served)):
        assert np.array_equal(snapshot.records, original.records[-50:])
        assert snapshot.communicators == original.communicators
        assert snapshot.header.calls_by_op == original.header.calls_by_op
        assert (snapshot.header.job, snapshot.header.rank) == ("llm-7", 3)
    middle = int(original.records["enqueue_ns"][len(original.records) // 2])
    last_serial = int(original.records["serial"][-1])
    _, body, _ = get(
        endpoint, f"/v1/jobs/llm-7/ranks/3/ring?since_ns={middle}&after_serial={last_serial - 10}"
    )
    served.write_bytes(body)
    assert read_ring(served).records["serial"].tolist() == list(range(last_serial - 9, last_serial + 1))
    _, body, headers = get(endpoint, f"/v1/jobs/llm-7/ranks/3/ring?until_ns={middle}", gzip_ok=False)
    assert "content-encoding" not in headers
    served.write_bytes(body)
    assert (read_ring(served).records["enqueue_ns"] < middle).all()
    status, body, _ = get(endpoint, "/v1/jobs/llm-7/dumps/rank-1.4242.0.dump")
    assert status == 200 and body == (trace_root / "llm-7" / "rank-1.4242.0.dump").read_bytes()


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/v1/jobs/..", 400, "'..'"),
        ("/v1/jobs/llm-7/../../secret", 400, "'..'"),
        ("/v1/jobs/%2e%2e/ranks/0", 400, "percent-encoded"),
        ("/v1/jobs/llm-7%2F..%2F..%2Fsecret", 400, "percent-encoded"),
        ("/v1/jobs/llm-7\\..\\secret", 400, "backslash"),
        ("/v1/jobs//etc", 400, "empty"),
        ("/v1/jobs/escape/ranks/0/ring", 403, "outside the trace root"),
        ("/v1/jobs/escape", 403, "outside the trace root"),
        ("/v1/jobs/llm-7/dumps/rank-9.1.1.dump", 403, "outside the trace root"),
        ("/v1/jobs/llm-7/dumps/passwd", 400, "not a stall dump name"),
        ("/v1/jobs/llm-7/ranks/0/ring", 413, "more than the 100 served at once"),
        ("/v1/jobs/llm-7/ranks/0/ring?last=5000", 413, "more than the 100 served"),
        ("/v1/jobs/llm-7/ranks/0/ring?last=ten", 400, "must be an integer"),
        ("/v1/jobs/llm-7/ranks/0/ring?path=/etc/passwd", 400, "unknown query key"),
        ("/v1/jobs/llm-7/ranks/x", 400, "not a rank number"),
        ("/v1/jobs/llm-7/ranks/12", 404, "no rank 12"),
        ("/v1/jobs/llm-8", 404, "no job 'llm-8'"),
        ("/v1/jobs/llm-8/ranks/0/ring?last=1", 404, "no job 'llm-8'"),
        ("/etc/passwd", 404, "not found"),
    ],
)
def test_refusals_say_why(endpoint: TraceEndpoint, path: str, status: int, says: str) -> None:
    got, body, headers = get(endpoint, path)
    assert got == status, body
    assert says in json.loads(body)["error"]
    assert headers["content-type"] == "application/json"


def test_a_token_is_required_and_never_echoed(endpoint: TraceEndpoint, trace_root: Path) -> None:
    for token in (None, "", "wrong", TOKEN + "x", TOKEN[:-1]):
        status, body, headers = get(endpoint, "/v1/jobs/llm-7", token=token)
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert b"llm-7" not in body and TOKEN.encode() not in body
    conn = http.client.HTTPConnection(*endpoint.address[:2], timeout=10)
    conn.request("GET", "/v1/jobs", headers={"Authorization": f"Basic {TOKEN}"})
    assert conn.getresponse().status == 401
    conn.close()


def test_a_rotated_token_takes_effect_without_a_restart(endpoint: TraceEndpoint) -> None:
    endpoint.token.path.write_text("rotated-token-2\n")
    assert get(endpoint, "/v1/jobs")[0] == 401
    assert get(endpoint, "/v1/jobs", token="rotated-token-2")[0] == 200


def test_busy_endpoint_answers_503(endpoint: TraceEndpoint) -> None:
    held = [endpoint.slots.acquire(blocking=False) for _ in range(2)]
    try:
        status, body, headers = get(endpoint, "/v1/jobs")
        assert json.loads(body) == {"error": "busy; try again"}
        assert status == 503 and headers["retry-after"] == "1"
    finally:
        for _ in held:
            endpoint.slots.release()
    assert get(endpoint, "/v1/jobs")[0] == 200


def test_its_requests_show_in_the_agents_metrics(trace_root: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = load(
        None,
        {
            "collectors": ["traces"],
            "trace_dir": str(trace_root),
            "trace_listen": f"127.0.0.1:{free_port()}",
            "trace_token_file": str(token),
        },
        environ={},
    )
    guarded = build_collectors(config)
    endpoint = guarded.collectors["traces"]
    try:
        get(endpoint, "/v1/jobs")
        get(endpoint, "/v1/jobs", token="no")
        text = render(guarded)
    finally:
        guarded.close()
    assert value(text, "megatrace_trace_endpoint_requests_total", code="200") == 1
    assert value(text, "megatrace_trace_endpoint_requests_total", code="401") == 1
    assert value(text, "megatrace_exporter_collector_up", collector="traces") == 1


def test_configuration_refuses_an_endpoint_without_token_and_unknown_collectors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key 'trace_token_file'"):
        load(None, {"collectors": "tracer,traces"}, environ={})
    with pytest.raises(
        ConfigError, match=r"unknown collector nfs \(known: gpu, infiniband, tracer, traces\)"
    ):
        load(None, {"collectors": "tracer,nfs"}, environ={})
    with pytest.raises(ConfigError, match="key 'trace_listen'"):
        load(None, {"trace_listen": "nowhere"}, environ={})
    assert load(None, {}, environ={}).collectors == ["gpu", "infiniband", "tracer"]
    missing = load(
        None,
        {
            "collectors": ["traces"],
            "trace_listen": f"127.0.0.1:{free_port()}",
            "trace_token_file": str(tmp_path / "no"),
        },
        environ={},
    )
    with pytest.raises(OSError):
        build_collectors(missing)


def _serving_pids(endpoint: TraceEndpoint) -> list[int]:
    processes = endpoint.workers._pool._processes
    assert processes, "the serving process is started with the endpoint"
    return list(processes)


def test_windows_are_cut_in_a_serving_process_of_lower_priority(endpoint: TraceEndpoint) -> None:
    assert get(endpoint, "/v1/jobs/llm-7/ranks/3/ring?last=50")[0] == 200
    (pid,) = _serving_pids(endpoint)
    assert pid != os.getpid()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + SERVE_NICE)


def test_a_dead_serving_process_is_replaced(endpoint: TraceEndpoint) -> None:
    path = "/v1/jobs/llm-7/ranks/2/ring?last=10"
    assert get(endpoint, path)[0] == 200
    (pid,) = _serving_pids(endpoint)
    os.kill(pid, signal.SIGKILL)
    status, body, headers = get(endpoint, path)
    assert (status, json.loads(body), headers["retry-after"]) == (503, {"error": "busy; try again"}, "1")
    assert get(endpoint, path)[0] == 200
    assert _serving_pids(endpoint) != [pid]


def test_refusals_raised_in_the_serving_process_keep_their_status(trace_root: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    small = TraceEndpoint(trace_root, ("127.0.0.1", 0), token, 100, 64, 2)
    try:
        status, body, _ = get(small, "/v1/jobs/llm-7/dumps/rank-1.4242.0.dump")
    finally:
        small.close()
    assert status == 413 and "more than the 64 served at once" in json.loads(body)["error"]


def test_a_ranks_ring_is_found_without_listing_the_job(
    endpoint: TraceEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    def listing(job: str) -> None:
        raise AssertionError("the job's folder was listed")

    monkeypatch.setattr(endpoint.store, "ranks", listing)
    assert get(endpoint, "/v1/jobs/llm-7/ranks/3/ring?last=5")[0] == 200
    assert get(endpoint, "/v1/jobs/llm-7/ranks/3")[0] == 200


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.mark.slow
def test_the_serving_process_ends_with_an_agent_killed_outright(trace_root: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    metrics, trace_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "megatrace.cli",
        "exporter",
        f"--listen=127.0.0.1:{metrics}",
        "--collectors=traces",
    ]
    env = {
        "MEGATRACE_EXPORTER_TRACE_DIR": str(trace_root),
        "MEGATRACE_EXPORTER_TRACE_LISTEN": f"127.0.0.1:{trace_port}",
        "MEGATRACE_EXPORTER_TRACE_TOKEN_FILE": str(token),
    }
    with running(argv, f"http://127.0.0.1:{metrics}/healthz", tmp_path / "agent.log", env=env) as agent:
        deadline = time.monotonic() + 60
        while not (children := _children(agent.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)  # the serving process (and multiprocessing's resource tracker) starting
        assert children, "the agent started no serving process"
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 60
    while (left := [pid for pid in children if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], "processes of the killed agent are still running"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "query",
    [
        "last=--5",
        "last=%C2%B2",  # '²': a digit to str.isdigit, not to int()
        "last=-",
        "last=1_000",
        "since_ns=9223372036854775808",
        "&".join(f"last={n}" for n in range(9)),  # more fields than parse_qsl is allowed to read
        "last=1&last=2&last=3&last=4&last=5&last=6&last=7&last=8&last=9&last=10",
    ],
)
def test_a_malformed_query_is_a_400_not_a_500(endpoint: TraceEndpoint, query: str) -> None:
    for path in ("/v1/jobs/llm-7/ranks/0/ring", "/v1/jobs/llm-7/dumps/rank-1.4242.0.dump"):
        status, body, headers = get(endpoint, f"{path}?{query}")
        assert status == 400, body
        assert headers["content-type"] == "application/json"
        assert json.loads(body)["error"]


def test_no_answer_names_a_path_on_the_server(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    S.write_ring_files(S.simulate(S.Scenario(world=2, tp=2, steps=4)), root / "job-a", job="job-a")
    ring = root / "job-a" / "rank-0.trace"
    os.truncate(ring, ring.stat().st_size // 2)  # a sound header over records cut short
    (root / "job-a" / "rank-1.trace").write_bytes(b"not a ring file at all" * 300)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    served = TraceEndpoint(root, ("127.0.0.1", 0), token, 100, 1 << 20, 2)
    try:
        for path in (
            "/v1/jobs/job-a/ranks/0/ring",
            "/v1/jobs/job-a/ranks/1/ring",
            "/v1/jobs/job-a/ranks/0",
            "/v1/jobs/job-a",
            "/v1/jobs/job-b",
            "/v1/jobs/job-a/dumps/rank-0.1.1.dump",
        ):
            status, body, _ = get(served, path)
            assert status in (200, 404), (path, status, body)
            assert str(tmp_path).encode() not in body and b"/traces" not in body, (path, body)
    finally:
        served.close()


def test_a_ranks_stacks_file_is_listed_and_served_whole(tmp_path: Path) -> None:
    """A real stacks file: a rank that held the GIL past its stall threshold (`stuck_rank gil`)."""
    root = tmp_path / "traces"
    held_gil_stacks(root / "job")
    (name,) = [path.name for path in (root / "job").glob("*.stacks")]
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    served = TraceEndpoint(root, ("127.0.0.1", 0), token, 100, 1 << 20, 2, node_name="gpu-node-7")
    try:
        listing = json.loads(get(served, "/v1/jobs/job")[1])
        assert listing["ranks"][0]["stacks"] == [name]
        status, body, _ = get(served, f"/v1/jobs/job/stacks/{name}")
        assert status == 200 and body == (root / "job" / name).read_bytes()
        (tmp_path / name).write_bytes(body)
        main = main_stack(read_stacks_file(tmp_path / name).stacks)
        assert main is not None and main.frames[0].function == "hold_the_gil"
        assert get(served, "/v1/jobs/job/stacks/passwd")[0] == 400
        assert get(served, f"/v1/jobs/job/stacks/{name}?last=1")[0] == 400
        assert get(served, "/v1/jobs/job/stacks/rank-0.1.stacks")[0] == 404
    finally:
        served.close()
