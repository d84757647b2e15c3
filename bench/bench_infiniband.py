"""InfiniBand parity with node_exporter on node_exporter's and procfs' own sysfs fixtures.

In one invocation, for each upstream fixture tree (unpacked from the projects' ttar archives):
  1. Debian's node_exporter (only its infiniband collector) and `megatrace exporter
     --collectors=infiniband` are started on the same tree and scraped over HTTP;
  2. every node_infiniband_* series is looked up as megatrace_infiniband_* with the same labels and
     value (equal / total, each difference printed), and the series only we have are listed;
  3. scrape latency p50/p95 and CPU per scrape of both, in the same run.
Then the hw_counters/ names: each file of procfs' mlx5 port is mapped to a series name as
node_exporter's current source does it (procfs' sysfs/class_infiniband.go: file -> field;
node_exporter's collector/infiniband_linux.go: field -> name) and compared with ours, and the
committed trees under tests/fixtures/sysfs are checked against the archives (drift).

Needs clones of prometheus/node_exporter and prometheus/procfs (git directories are enough):

    .venv/bin/python bench/bench_infiniband.py --node-exporter-git DIR --procfs-git DIR [--scrapes 300]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_exporter import measure  # noqa: E402
from megatrace.exporters.infiniband import HW_COUNTERS, HW_LIFESPAN  # noqa: E402
from tests.exporters.exposition import samples  # noqa: E402
from tests.support.services import free_port, wait_http  # noqa: E402
from tests.support.ttar import extract  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "sysfs"
# (name, which repository, archive in it, prefix of sysfs in the archive)
TREES = [
    ("node_exporter", "node_exporter", "collector/fixtures/sys.ttar", "sys"),
    ("procfs", "procfs", "testdata/fixtures.ttar", "fixtures/sys"),
]
MLX5_PORT = "class/infiniband/mlx5_0/ports/1"


def git_show(git_dir: Path, spec: str) -> bytes:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", spec], check=True, capture_output=True
    ).stdout


def git_head(git_dir: Path) -> str:
    return git_show(git_dir, "--no-patch").split()[1].decode()


def scrape(argv: list[str], port: int, log: Path) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(url, timeout=60, proc=proc)
        return requests.get(url, timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def node_exporter_argv(binary: str, sysfs: Path, port: int) -> list[str]:
    return [
        binary,
        f"--path.sysfs={sysfs}",
        "--collector.disable-defaults",
        "--collector.infiniband",
        f"--web.listen-address=127.0.0.1:{port}",
    ]


def agent_argv(sysfs: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatrace.cli",
        "exporter",
        f"--listen=127.0.0.1:{port}",
        f"--sysfs-root={sysfs}",
        "--collectors=infiniband",
    ]


def compare(theirs_text: str, ours_text: str) -> tuple[int, int, list[str], list[str]]:
    """(equal, total, differences, series only ours) over node_infiniband_* series."""
    theirs = {
        ("megatrace_" + name.removeprefix("node_"), labels): value
        for (name, labels), value in samples(theirs_text).items()
        if name.startswith("node_infiniband_")
    }
    ours = {
        key: value for key, value in samples(ours_text).items() if key[0].startswith("megatrace_infiniband_")
    }
    differences = [
        f"{name}{dict(labels)}: node_exporter {value}, ours {ours.get((name, labels))}"
        for (name, labels), value in sorted(theirs.items())
        if ours.get((name, labels)) != value
    ]
    only_ours = sorted({name for name, labels in set(ours) - set(theirs)})
    return len(theirs) - len(differences), len(theirs), differences, only_ours


def source_hw_names(node_exporter_git: Path, procfs_git: Path) -> dict[str, str]:
    """hw_counters/<file> -> node_exporter's metric name after node_infiniband_, from both sources."""
    procfs_go = git_show(procfs_git, "HEAD:sysfs/class_infiniband.go").decode()
    hw_part = procfs_go[procfs_go.index("func parseInfiniBandHwCounters") :]
    field_of_file = dict(re.findall(r'case "(\w+)":\s*hwCounters\.(\w+) =', hw_part))
    collector_go = git_show(node_exporter_git, "HEAD:collector/infiniband_linux.go").decode()
    name_of_field = {
        field: name
        for name, field in re.findall(r'c\.push\w+\(ch, "(\w+)", \*?\(?port\.HwCounters\.(\w+)', collector_go)
    }
    return {file: name_of_field[field] for file, field in field_of_file.items() if field in name_of_field}


def drift(extracted: Path, committed: Path) -> list[str]:
    """Files that differ between an extracted upstream tree and the committed one."""

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    got, have = files(extracted / "class" / "infiniband"), files(committed / "class" / "infiniband")
    return sorted(name for name in got.keys() | have.keys() if got.get(name) != have.get(name))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--node-exporter-git", type=Path, required=True, help="prometheus/node_exporter clone"
    )
    parser.add_argument("--procfs-git", type=Path, required=True, help="prometheus/procfs clone")
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()
    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if node_exporter is None:
        print("node_exporter is not installed (Debian package prometheus-node-exporter)", file=sys.stderr)
        return 1
    version = subprocess.run([node_exporter, "--version"], capture_output=True, text=True)
    repos = {"node_exporter": args.node_exporter_git, "procfs": args.procfs_git}
    print(f"node_exporter binary: {(version.stdout or version.stderr).splitlines()[0]}")
    for repo, git_dir in repos.items():
        print(f"{repo} source: {git_head(git_dir)}")
    timings = []
    with tempfile.TemporaryDirectory(prefix="megatrace-bench-ib-") as tmp:
        work = Path(tmp)
        for name, repo, archive, prefix in TREES:
            sysfs = work / name
            extract(git_show(repos[repo], f"HEAD:{archive}"), sysfs, prefix)
            changed = drift(sysfs, FIXTURES / name)
            print(f"\n== {name}: {repo}:{archive} ({prefix}); committed tree differs in {len(changed)} files")
            for path in changed:
                print(f"   drift: {path}")
            port = free_port()
            theirs = scrape(node_exporter_argv(node_exporter, sysfs, port), port, work / f"{name}-ne.log")
            port = free_port()
            ours = scrape(agent_argv(sysfs, port), port, work / f"{name}-agent.log")
            equal, total, differences, only_ours = compare(theirs, ours)
            print(f"series equal (name, labels, value): {equal}/{total}")
            for line in differences:
                print(f"   differs: {line}")
            print(f"series only ours ({len(only_ours)} names): {', '.join(only_ours)}")
            if name == "procfs":
                expected = source_hw_names(args.node_exporter_git, args.procfs_git)
                files = sorted(p.name for p in (sysfs / MLX5_PORT / "hw_counters").iterdir())
                ours_names = {n for n, labels in samples(ours) if ("device", "mlx5_0") in labels}
                hits = [f for f in files if f"megatrace_infiniband_{expected.get(f)}" in ours_names]
                print(
                    f"hw_counters names as node_exporter's source on procfs' mlx5_0: {len(hits)}/{len(files)}"
                )
                for file in sorted(set(files) - set(hits)):
                    print(f"   not matched: hw_counters/{file} (source: {expected.get(file)})")
                lines = (FIXTURES / "node_exporter_hw_names.tsv").read_text().splitlines()
                committed = dict(line.split("\t") for line in lines if line and not line.startswith("#"))
                print(
                    f"tests/fixtures/sysfs/node_exporter_hw_names.tsv as the sources: {committed == expected}"
                )
                table = {**HW_COUNTERS, HW_LIFESPAN: "lifespan_seconds"}
                same = [f for f, n in expected.items() if table.get(f) == n]
                print(f"our hw_counters table vs the source's {len(expected)} files: {len(same)} same names")
                for file in sorted(set(expected) - set(same)):
                    print(f"   differs: hw_counters/{file}: source {expected[file]}, ours {table.get(file)}")
            port = free_port()
            argv = node_exporter_argv(node_exporter, sysfs, port)
            timings.append(measure(f"node_exporter on {name}", argv, port, args.scrapes, work / "ne.log"))
            port = free_port()
            argv = agent_argv(sysfs, port)
            timings.append(measure(f"megatrace on {name}", argv, port, args.scrapes, work / "agent.log"))
    print(f"\n{args.scrapes} scrapes each over HTTP, same trees, same run")
    print(f"{'server':35} {'series':>6} {'p50 ms':>8} {'p95 ms':>8} {'CPU ms/scrape':>14} {'RSS MiB':>8}")
    for run in timings:
        print(
            f"{run['name']:35} {run['series']:>6} {run['p50_ms']:>8.2f} {run['p95_ms']:>8.2f} "
            f"{run['cpu_ms']:>14.2f} {run['rss_mib']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
