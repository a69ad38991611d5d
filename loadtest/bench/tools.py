"""Find (or install) the external programs the bench compares against, never failing the bench for them.

nginx and wrk come from the OS packages (``apt-get`` when we are root); the Rust peer routers come from
PyPI into their own venv (``.bench-venv``) so they never touch the project's dependencies. A tool that
cannot be had is ``None``: its rows are skipped with a loud message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

APT_PACKAGES = ("nginx", "wrk")
PEER_PACKAGES = ("sglang-router", "vllm-router")
INSTALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Tools:
    nginx: str | None
    wrk: str | None
    sglang_router: str | None
    vllm_router: str | None


def warn(message: str) -> None:
    print(f"\n*** bench: {message} ***\n", file=sys.stderr, flush=True)


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/usr/local/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def _run_quiet(argv: list[str]) -> bool:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_apt(install: bool) -> None:
    missing = [p for p in APT_PACKAGES if _which(p) is None]
    if not missing or not install:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        warn(f"{', '.join(missing)} missing and not installable here (needs root + apt-get)")
        return
    print(f"bench: installing {' '.join(missing)} with apt-get ...", file=sys.stderr, flush=True)
    env_ok = _run_quiet(["apt-get", "update", "-qq"])
    if not env_ok or not _run_quiet(["apt-get", "install", "-y", "-qq", *missing]):
        warn(f"apt-get install {' '.join(missing)} failed")


def ensure_peers(venv: Path, install: bool) -> tuple[str | None, str | None]:
    """The sglang-router and vllm-router launchers in ``venv`` (created and filled when allowed)."""
    bins = {name: venv / "bin" / name for name in PEER_PACKAGES}
    missing = [name for name, path in bins.items() if not path.exists()]
    if missing and install:
        print(f"bench: pip install {' '.join(missing)} into {venv} ...", file=sys.stderr, flush=True)
        if not (venv / "bin" / "pip").exists() and not _run_quiet([sys.executable, "-m", "venv", str(venv)]):
            warn(f"cannot create {venv}")
        for name in missing:
            if not _run_quiet([str(venv / "bin" / "pip"), "install", "-q", name]):
                warn(f"pip install {name} failed (its rows will be skipped)")
    found = [str(p) if p.exists() else None for p in bins.values()]
    return found[0], found[1]


def find_tools(venv: Path, install: bool = True) -> Tools:
    ensure_apt(install)
    sglang, vllm = ensure_peers(venv, install)
    tools = Tools(_which("nginx"), _which("wrk"), sglang, vllm)
    for field, value in vars(tools).items():
        if value is None:
            warn(f"{field.replace('_', '-')} not available: its rows are skipped")
    return tools
