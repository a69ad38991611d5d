"""How each router under test is started in front of one SGLang-shaped upstream (all on 127.0.0.1)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .procs import Proc, free_port

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RouterSpec:
    """``kind`` is kvrouter, sglang-router or vllm-router; ``policy`` in that router's own names."""

    kind: str
    policy: str
    workers: int = 1
    redis_url: str | None = None
    policy_arg: str | None = None  # what --policy gets, when it differs from the label's ``policy``

    @property
    def label(self) -> str:
        extra = f" x{self.workers}" if self.workers > 1 else ""
        return f"{self.kind} ({self.policy}{extra})"


def kvrouter_bin() -> str:
    return str(Path(sys.executable).parent / "kvrouter")


def router_proc(
    spec: RouterSpec, upstream_url: str, log_dir: Path, peer_bin: str | None = None
) -> tuple[Proc, str]:
    """An unstarted router process in front of ``upstream_url`` and the URL it will answer on."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if spec.kind == "kvrouter":
        argv = [kvrouter_bin(), "serve", "--backend", f"sglang={upstream_url}", "--port", str(port),
                "--policy", spec.policy_arg or spec.policy, "--log-level", "warning",
                "--workers", str(spec.workers)]  # fmt: skip
        if spec.redis_url:
            argv += ["--redis-url", spec.redis_url]
        return Proc(spec.label, argv, ready_url=url + "/ready", ready_timeout_s=READY_TIMEOUT_S,
                    log_dir=log_dir), url  # fmt: skip
    if peer_bin is None:
        raise ValueError(f"{spec.kind} is not installed")
    workers = [upstream_url]
    if spec.kind == "sglang-router" and spec.policy == "power_of_two":
        # sglang-router checks ">= 2 workers" on the URLs given, before --dp-aware expands one URL into a
        # worker per DP rank, so one DP-attention node cannot start power_of_two. The same engine under a
        # second host name passes the check: every rank then appears twice, and the pair of candidates
        # is still drawn over ranks (with each alias counting its own in-flight requests).
        workers.append(upstream_url.replace("127.0.0.1", "localhost"))
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
              "--policy", spec.policy, "--prometheus-port", str(free_port())]  # fmt: skip
    if spec.kind == "sglang-router":
        argv = [peer_bin, "launch", *common, "--dp-aware", "--log-level", "warn"]
    elif spec.kind == "vllm-router":
        argv = [peer_bin, *common, "--intra-node-data-parallel-size", "8", "--log-level", "warning"]
    else:
        raise ValueError(f"unknown router kind {spec.kind!r}")
    return Proc(spec.label, argv, ready_url=url + "/readiness", ready_timeout_s=READY_TIMEOUT_S,
                log_dir=log_dir), url  # fmt: skip
