"""deploy/compose/docker-compose.emulated.yml "run by hand": the redis, emulator and router commands are
taken from the compose file, hosts and ports rewritten to free loopback ports, started as plain processes
(no Docker), and one chat completion goes end to end through the router."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy/compose/docker-compose.emulated.yml"
BIN = Path(sys.executable).parent
STARTUP_S = 40.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command_works(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def rewrite(argv: list[str], own: int, ports: dict[str, tuple[int, int]]) -> list[str]:
    """The service's own ``--port`` -> ``own``; ``service:port`` -> 127.0.0.1 and its free port; 0.0.0.0 ->
    127.0.0.1."""
    out: list[str] = []
    for token in (str(t) for t in argv):
        token = token.replace("0.0.0.0", "127.0.0.1")
        for service, (compose_port, port) in ports.items():
            token = token.replace(f"{service}:{compose_port}", f"127.0.0.1:{port}")
        out.append(str(own) if out[-1:] == ["--port"] else token)
    return out


def resolve(argv: list[str]) -> list[str]:
    exe = BIN / argv[0] if (BIN / argv[0]).exists() else shutil.which(argv[0])
    assert exe, f"{argv[0]} not found"
    return [str(exe), *argv[1:]]


def own_port(argv: list[str]) -> int:
    return int(argv[argv.index("--port") + 1])


@contextlib.contextmanager
def started(name: str, argv: list[str], logs: Path) -> Iterator[subprocess.Popen[bytes]]:
    with (logs / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_http(url: str, procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            pytest.fail(f"exited early: {dead}\n" + tail(logs))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{url} not ready after {STARTUP_S} s\n" + tail(logs))


def tail(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(logs.glob("*.log"))
    )


@pytest.mark.slow
def test_emulated_compose_serves_a_request_end_to_end(tmp_path: Path) -> None:
    if not command_works([str(BIN / "kvrouter"), "serve", "--help"]):
        pytest.skip("`kvrouter serve` is not available yet (gateway not built)")
    if not command_works([str(BIN / "kvrouter-loadtest"), "emulate", "--help"]):
        pytest.skip("`kvrouter-loadtest emulate` is not available yet (emulator not built)")
    if shutil.which("redis-server") is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary on PATH; install it to run this test")

    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    argv = {
        n: [*services[n].get("entrypoint", []), *services[n]["command"]]
        for n in ("redis", "emulator", "router")
    }
    ports = {n: (own_port([str(t) for t in argv[n]]), free_port()) for n in argv}
    commands = {n: resolve(rewrite(a, ports[n][1], ports)) for n, a in argv.items()}
    assert "--redis-url" in commands["router"] and "--backend" in commands["router"]

    with contextlib.ExitStack() as stack:
        # All at once, as compose would after its health checks: the router re-discovers a backend that
        # was not up yet, and /ready waits for it.
        procs = [
            stack.enter_context(started(n, commands[n], tmp_path)) for n in ("redis", "emulator", "router")
        ]
        base = f"http://127.0.0.1:{ports['router'][1]}"
        wait_http(f"http://127.0.0.1:{ports['emulator'][1]}/health", procs, tmp_path)
        wait_http(f"{base}/ready", procs, tmp_path)

        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            reply = client.chat.completions.create(
                model="deepseek-ai/DeepSeek-V3",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
            )
        assert reply.choices[0].message.content, tail(tmp_path)
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8

        ranks = httpx.get(f"{base}/ranks", timeout=5).json()
        (backend,) = ranks["backends"]
        assert backend["engine"] == "sglang" and len(backend["ranks"]) == 8
        # The request finished: its reservation went back to the ledger (shared through the compose Redis).
        assert sum(r["reserved_tokens"] for r in backend["ranks"]) == 0, ranks
