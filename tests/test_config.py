"""Settings precedence (flags > env > file > defaults), list parsing, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from router.cli import app
from router.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVROUTER_"):
            monkeypatch.delenv(key)


def test_defaults() -> None:
    s = load_settings()
    assert (s.host, s.port, s.policy, s.redis_url, s.workers) == ("127.0.0.1", 8080, "lockstep", None, 1)
    assert s.ledger_failure_mode == "fail_closed" and s.backends == []
    assert s.ledger_path is None and not s.shared_memory_ledger()


def test_workers_pick_their_shared_ledger() -> None:
    """Several workers share a ledger: shared memory on this host unless Redis is given (one worker: none)."""
    assert load_settings(workers=2).shared_memory_ledger()
    assert not load_settings(workers=2, redis_url="redis://r:6379").shared_memory_ledger()
    assert load_settings(workers=3, ledger_path="/dev/shm/kv").ledger_path == "/dev/shm/kv"


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("port: 9001\npolicy: kv_fit\nqueue-max: 7\nbackends: ['sglang=http://a:1']\n")
    monkeypatch.setenv("KVROUTER_POLICY", "round_robin")
    s = load_settings(config_file=str(cfg))
    assert (s.port, s.policy, s.queue_max) == (9001, "round_robin", 7)
    assert s.backend_specs()[0].urls == ("http://a:1",)
    s = load_settings(config_file=str(cfg), policy="least_requests", port=None)
    assert (s.port, s.policy) == (9001, "least_requests")


def test_env_lists_and_json_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTER_BACKENDS", "sglang=http://a:1; vllm-external=http://b:1,http://b:2")
    monkeypatch.setenv("KVROUTER_API_KEYS", '["k1", "k2"]')
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"ledger_failure_mode": "open"}')
    monkeypatch.setenv("KVROUTER_CONFIG", str(cfg))
    s = load_settings()
    assert [b.engine for b in s.backend_specs()] == ["sglang", "vllm-external"]
    assert s.backend_specs()[1].urls == ("http://b:1", "http://b:2")
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert s.ledger_failure_mode == "fail_open"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backends": ["nope=http://x"]}, "unknown engine"),
        ({"port": 70000}, "port"),
        ({"workers": 2, "ledger_path": "/dev/shm/x", "redis_url": "redis://r:6379"}, "two ledgers"),
        ({"ledger_path": "/dev/shm/x"}, "ledger_path is for workers > 1"),
        ({"ledger_failure_mode": "sideways"}, "failure mode"),
        ({"queue_timeout_s": 0}, "queue_timeout_s"),
    ],
)
def test_bad_values_give_one_line(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(config_file=str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_settings(config_file=str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("colour: blue\n")
    with pytest.raises(ConfigError, match="colour"):
        load_settings(config_file=str(unknown))


def test_serve_cli_errors_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, needle in [
        (["serve"], "no backend configured"),
        (["serve", "--backend", "sglang=ftp://x"], "must start with http"),
        (["serve", "--backend", "sglang=http://x", "--policy", "nope"], "unknown policy"),
        (["serve", "--config", str(tmp_path / "absent.yaml")], "cannot read"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert needle in result.output
