"""`kvrouter plan` as users call it: JSON contract keys, table, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from router.cli import app

LAYOUT_KEYS = {
    "ranks",
    "kv_bytes_per_token_per_rank",
    "weights_bytes_per_gpu",
    "kv_bytes_per_gpu",
    "kv_tokens_per_rank",
    "kv_tokens_total",
    "seqs_at_context",
    "seqs_at_context_pooled",
    "kv_read_ms_per_step",
    "attn_weight_read_ms_per_step",
}


class Outcome:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def kvrouter(*args: str) -> Outcome:
    """In-process: a subprocess per case costs seconds on a busy box; one test below runs the binary."""
    result = CliRunner().invoke(app, list(args), terminal_width=120)
    return Outcome(result.exit_code, result.stdout, result.stderr)


def test_console_script_runs_as_a_process() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "plan", "--gpus", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "kvrouter: error: --gpus must be positive, got 0"


def test_plan_json_contract() -> None:
    out = kvrouter("plan", "--model", "deepseek-v3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["kv_bytes_per_token"] == 70_272
    assert {"params_total", "attn_params_per_layer", "capacity_ratio"} <= doc.keys()
    for name in ("tp", "dp_ep"):
        assert doc["layouts"][name].keys() >= LAYOUT_KEYS
    assert doc["layouts"]["dp_ep"]["seqs_at_context"] == 992
    assert doc["layouts"]["tp"]["kv_tokens_total"] == pytest.approx(652_393, rel=1e-3)


def test_plan_fp8_and_llama() -> None:
    fp8 = json.loads(kvrouter("plan", "--kv-dtype", "fp8", "--json").stdout)
    assert fp8["kv_bytes_per_token"] == 35_136
    llama = json.loads(kvrouter("plan", "--model", "llama-3.3-70b", "--json").stdout)
    assert llama["kv_bytes_per_token"] == 327_680
    assert llama["layouts"]["tp"]["kv_bytes_per_token_per_rank"] == 40_960


def test_plan_table_for_people() -> None:
    out = kvrouter("plan")
    assert out.returncode == 0
    assert "4,081,832" in out.stdout and "652,346" in out.stdout and "6.26x" in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "gpt-5"], "known presets: deepseek-v3, llama-3.3-70b"),
        (["--gpus", "0"], "--gpus must be positive"),
        (["--context", "-1"], "--context must be positive"),
        (["--gpu", "h100"], "short by 10.3 GB"),
        (["--kv-dtype", "fp7"], "unknown dtype 'fp7'"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    out = kvrouter("plan", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_plan_config_json_missing_field(tmp_path: Path) -> None:
    cfg = json.loads(Path("router/presets/deepseek-v3.json").read_text())
    del cfg["kv_lora_rank"]
    cfg_path = tmp_path / "config.json"
    # Without kv_lora_rank the model reads as MHA: a valid but different architecture.
    cfg_path.write_text(json.dumps(cfg))
    assert kvrouter("plan", "--model", str(cfg_path), "--json").returncode == 0
    del cfg["hidden_size"]
    cfg_path.write_text(json.dumps(cfg))
    out = kvrouter("plan", "--model", str(cfg_path))
    assert out.returncode == 2 and "missing field 'hidden_size'" in out.stderr


def test_plan_help_explains_options() -> None:
    out = kvrouter("plan", "--help")
    assert out.returncode == 0
    for opt in ("--model", "--gpu", "--gpus", "--context", "--kv-dtype", "--json"):
        assert opt in out.stdout
