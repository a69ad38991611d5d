"""``make demo`` runs bounded: emulator and router as child processes, a burst, the per-rank table."""

from __future__ import annotations

import subprocess
import sys


def test_demo_burst_only_prints_the_rank_table_and_releases_everything() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.demo", "--burst-only", "--requests", "24", "--concurrency", "12"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "busiest moment" in out.stdout and "24/24 requests OK" in out.stdout
    after = out.stdout.split("After the burst")[1]
    rows = [line for line in after.splitlines() if "sglang-0" in line]
    assert len(rows) == 8
    for row in rows:
        cells = [c.strip() for c in row.split("│") if c.strip()]
        assert cells[3] == "0" and cells[5] == "0", row  # reserved, in flight


def test_demo_rejects_bad_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.demo", "--requests", "0"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
