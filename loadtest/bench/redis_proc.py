"""A throwaway ``redis-server`` on a free loopback port in a temp dir (tests and benchmarks).

No persistence (``--save "" --appendonly no``): a restart starts empty, exactly the failure the ledger must
survive. ``restart()`` reuses the port so clients reconnect to the same URL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

READY_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """``with RedisServer() as srv: srv.url`` — starts on enter, stops (and removes its dir) on exit."""

    def __init__(self, port: int | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server not found on PATH")
        self._binary = binary
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvr-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name, "--logfile", "redis.log"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()  # abrupt on purpose: a crash, not a clean shutdown (SIGKILL also ends a paused one)
        proc.wait(timeout=READY_TIMEOUT_S)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers, like a hung Redis."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                raise RuntimeError(f"redis-server exited with {code} (port {self.port} taken?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} not ready after {READY_TIMEOUT_S} s")

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._dir.cleanup()
