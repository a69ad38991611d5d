"""A fast static upstream that routers can discover: SGLang-shaped answers served by nginx.

The answers are captured once from the emulator (so they follow the same SGLang API the gateway and the
peers parse): ``/server_info`` (dp_size 8), ``/v1/models``, ``/v1/loads``, ``/get_load``, and a fixed
16-token chat completion for every POST. nginx returns them from memory (``return 200 '...'``), which
is what makes it a fair "zero-cost engine" for router overhead.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from loadtest.emulator.app import EmulatorSettings
from loadtest.emulator.host import EmulatorThread

from .procs import Proc, free_port

DP_SIZE = 8
KV_TOKENS_PER_RANK = 10_000_000  # far more than any bench holds: the ledger never queues
GET_PATHS = (
    "/server_info", "/get_server_info", "/v1/models", "/v1/loads", "/get_load", "/model_info",
    "/get_model_info",
)  # fmt: skip
POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class Payloads:
    """Path → JSON body served by the static upstream, and the request the load client sends."""

    bodies: dict[str, bytes]
    model: str

    def chat_request(self, stream: bool = False, max_tokens: int = OUTPUT_TOKENS) -> bytes:
        return orjson.dumps({
            "model": self.model, "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": max_tokens, "stream": stream,
        })  # fmt: skip


def capture_payloads() -> Payloads:
    """Ask an in-process emulator (time scale 0) for every answer the static upstream serves."""
    settings = EmulatorSettings(
        engine="sglang", dp_size=DP_SIZE, port=0, kv_tokens_per_rank=KV_TOKENS_PER_RANK, time_scale=0.0,
        output_len_dist=f"fixed:{OUTPUT_TOKENS}",
    )  # fmt: skip
    with EmulatorThread(settings) as emu, httpx.Client(base_url=emu.url, timeout=10.0) as http:
        bodies = {path: http.get(path).content for path in GET_PATHS}
        model = str(http.get("/v1/models").json()["data"][0]["id"])
        payloads = Payloads(bodies, model)
        chat = http.post("/v1/chat/completions", content=payloads.chat_request(),
                         headers={"Content-Type": "application/json"})  # fmt: skip
        chat.raise_for_status()
    for path in POST_PATHS:
        bodies[path] = chat.content
    return payloads


def _nginx_string(body: bytes) -> str:
    text = body.decode()
    if "$" in text:
        raise ValueError("nginx return text cannot hold '$' (variable syntax)")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_conf(payloads: Payloads, port: int, workdir: Path) -> str:
    locations = []
    for path, body in payloads.bodies.items():
        if path in POST_PATHS:  # nginx's static module refuses POST; `return` answers any method
            answer = f"return 200 {_nginx_string(body)};"
        else:  # GET answers can exceed nginx's 4 KiB parameter limit: serve them as files
            file = workdir / (path.strip("/").replace("/", "_") + ".json")
            file.write_bytes(body)
            answer = f"alias {file};"
        locations.append(f"    location = {path} {{ default_type application/json; {answer} }}")
    locations += [
        "    location = /health { return 200 ''; }",
        "    location = /health_generate { return 200 ''; }",
        "    location = /metrics { default_type text/plain; return 200 ''; }",
        "    location / { default_type application/json; return 200 '{}'; }",
    ]
    temps = " ".join(
        f"{k}_temp_path {workdir}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return "\n".join([
        "worker_processes 1;", "daemon off;", f"pid {workdir}/nginx.pid;",
        f"error_log {workdir}/error.log warn;", "events { worker_connections 8192; }",
        "http {", "  access_log off;", "  keepalive_requests 10000000;", "  keepalive_timeout 120s;",
        f"  {temps}", "  server {", f"    listen 127.0.0.1:{port} reuseport backlog=4096;",
        *locations, "  }", "}", "",
    ])  # fmt: skip


def nginx_proc(nginx: str, payloads: Payloads, log_dir: Path) -> tuple[Proc, str]:
    """An unstarted nginx serving ``payloads``; returns it and its base URL."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-nginx-"))
    workdir.chmod(0o755)  # nginx workers drop root privileges and must read the answer files
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_conf(payloads, port, workdir))
    url = f"http://127.0.0.1:{port}"
    argv = [nginx, "-c", str(conf), "-p", str(workdir), "-e", str(workdir / "error.log")]
    return Proc("nginx", argv, ready_url=url + "/health", log_dir=log_dir), url
