"""Child processes of a benchmark: started with a log file, awaited on an HTTP probe, always stopped.

Every process the bench starts is a :class:`Proc` used as a context manager, so an exception (or Ctrl-C)
anywhere still terminates it — by its own pid, never by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

STOP_TIMEOUT_S = 5.0


class ProcError(RuntimeError):
    """A child that would not start or answer; the message names its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Proc:
    """``with Proc(name, argv, ready_url=...) as p:`` — started, probed until ready, stopped on exit."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready_url: str | None = None,
        ready_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.ready_url = ready_url
        self.ready_timeout_s = ready_timeout_s
        self.env = {**os.environ, **(env or {})}
        directory = log_dir or Path(tempfile.gettempdir())
        directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / f"kvbench-{name}-{os.getpid()}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> Proc:
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )
        if self.ready_url is not None:
            self._await_ready(self.ready_url)
        return self

    def _await_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise ProcError(f"{self.name} exited with {self._proc.returncode}; see {self.log_path}")
            if http_ok(url):
                return
            time.sleep(0.1)
        self.stop()
        raise ProcError(
            f"{self.name} not ready at {url} after {self.ready_timeout_s:g} s; see {self.log_path}"
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> Proc:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def wait_until(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_ok(url):
            return True
        time.sleep(0.1)
    return False
