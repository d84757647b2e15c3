"""A real PostgreSQL server (Debian's ``postgresql`` package) for tests, on a loopback port.

`PostgresServer` runs ``initdb`` into a fresh temporary directory and starts ``postgres`` there. The
server refuses to run as root, so under root both run as the package's ``postgres`` system user,
which owns the directory. Durability settings are off: tests kill the bot, never the database.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.services import free_port

SUPERUSER = "megatrace"


def postgres_bindir() -> Path:
    """The newest installed server's programs; fails the test when `make test` did not install it."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        pytest.fail("PostgreSQL is not installed; `make test` installs Debian's postgresql package")
    return Path(found[-1]).parent


class PostgresServer:
    """One throw-away server; `database()` creates an empty database and returns its URL."""

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="megatrace-pg-"))
        self.user = "postgres" if os.geteuid() == 0 else None
        self.proc: subprocess.Popen | None = None

    def _run_as(self) -> dict:
        return {"user": self.user, "group": self.user} if self.user else {}

    def start(self) -> PostgresServer:
        data = self.dir / "data"
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
            cwd=self.dir,
            **self._run_as(),
        )
        self._launch()
        return self

    def _launch(self) -> None:
        data = self.dir / "data"
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            [
                str(self.bindir / "postgres"),
                "-D",
                str(data),
                "-p",
                str(self.port),
                "-k",
                str(self.dir),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=50",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            **self._run_as(),
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.dir / "server.log").read_text(errors="replace")
                raise RuntimeError(f"postgres exited: {log}")
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        name = f"bot_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def halt(self) -> None:
        """Stop the server as an outage would (clients disconnected), keeping its data for `resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        self._log.close()

    def resume(self) -> None:
        """Start the halted server again on the same port and data."""
        self._launch()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: disconnects clients
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()
