"""Run mypy on packages of the project as Python imports them (``megatrace.alertbot``, …).

The source folders are mapped onto ``megatrace.*`` by setuptools' ``package-dir``, which mypy cannot
follow, so this lays the mapping out as symbolic links in a scratch folder and checks the packages
there with the project's mypy settings. Usage: ``python tests/support/typecheck.py alertbot [...]``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("alertbot", "analyzer", "exporters", "tracer")


def main(packages: list[str]) -> int:
    unknown = sorted(set(packages) - set(PACKAGES))
    if unknown or not packages:
        print(f"usage: typecheck.py {{{','.join(PACKAGES)}}} ... (unknown: {unknown})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="megatrace-mypy-") as scratch:
        tree = Path(scratch) / "megatrace"
        tree.mkdir()
        for name in PACKAGES:
            (tree / name).symlink_to(ROOT / name)
        for module in (ROOT / "core").glob("*.py"):
            (tree / module.name).symlink_to(module)
        command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        command += ["--follow-imports=silent", *(arg for p in packages for arg in ("-p", f"megatrace.{p}"))]
        return subprocess.run(
            command, cwd=scratch, env={"MYPYPATH": scratch, "PATH": ""}, check=False
        ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
