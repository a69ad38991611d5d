"""Gateway settings: one pydantic-settings object, built once and passed to ``create_app``.

Precedence (highest first): explicit keyword arguments (the CLI flags), ``KVROUTER_*`` environment variables,
the ``--config`` YAML/JSON file (also ``KVROUTER_CONFIG``), then the defaults below.
List fields accept a JSON list or, from the environment, a ``;``/whitespace-separated string (``,`` separates
the per-rank URLs of ``vllm-external`` backends, so it cannot separate backends).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import orjson
import yaml
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from router.backends.base import BackendSpec
from router.ledger.factory import check_failure_mode, check_namespace
from router.reservation import PredictorConfig, ReservationMode, ReservationSettings
from router.reservation.overcommit import BOUNDS


class ConfigError(ValueError):
    """A config file or value that cannot build Settings (one line, for CLI exit 2)."""


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return orjson.loads(text)
        return [part for part in text.replace(";", " ").split() if part]
    return value


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML or JSON mapping of setting names (``-`` or ``_``) to values."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = orjson.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {str(path)!r} is not valid YAML/JSON: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of setting names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Lowest-priority source: the file named by the ``config_file`` argument or ``KVROUTER_CONFIG``."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | None) -> None:
        super().__init__(settings_cls)
        self._values = read_config_file(Path(path)) if path else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTER_", extra="forbid", validate_default=True)

    config_file: str | None = Field(None, description="YAML/JSON settings file (lowest precedence).")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    backends: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="ENGINE=URL: sglang=URL, vllm=URL, vllm-external=URL0,URL1,...",
    )
    policy: str = "lockstep"
    redis_url: str | None = None
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    admin_token: SecretStr | None = Field(None, description="Bearer token required by /ranks when set.")
    default_max_tokens: int = Field(512, ge=1, description="Output reservation when a request sets no limit.")
    tokenizer_path: str | None = Field(None, description="tokenizer.json for exact prompt counts.")
    bytes_per_token: float = Field(4.0, gt=0, description="Byte estimate without a tokenizer.")
    estimate_safety_factor: float = Field(1.25, ge=1.0, description="x byte-estimated prompt.")
    chat_message_overhead_tokens: int = Field(4, ge=0)
    queue_max: int = Field(256, ge=0, description="Requests that may wait for capacity; more get 429.")
    queue_timeout_s: float = Field(30.0, gt=0, description="Longest wait for capacity before 503.")
    request_timeout_s: float = Field(600.0, gt=0, description="Whole upstream request, stream included.")
    connect_timeout_s: float = Field(5.0, gt=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    retry_attempts: int = Field(3, ge=1, description="Ranks tried before the first byte reaches the client.")
    reconcile_interval_s: float = Field(1.0, gt=0)
    probe_interval_s: float = Field(
        5.0, gt=0, description="A rank tripped by its breaker is probed this often."
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="SIGTERM: in-flight requests may finish this long before being cut."
    )
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="Largest request head (431 above).")
    workers: int = Field(1, ge=1)
    replicas: int = Field(
        1,
        ge=1,
        description="Router replicas sharing the Redis namespace, each with `workers` processes: while Redis "
        "is down, fail_open splits the room free at the last read among replicas x workers.",
    )
    ledger_namespace: str = Field("default", description="Redis key namespace; one per deployment.")
    ledger_path: str | None = Field(
        None,
        description="workers > 1 without redis_url: the workers' shared-memory ledger file (default: a new "
        "file in /dev/shm). Each serve creates it afresh and removes it at exit.",
    )
    lease_ttl_s: float = Field(60.0, gt=0, description="Reservation lease; renewed while live.")
    ledger_failure_mode: str = Field(
        "fail_closed", description="Redis unreachable: fail_closed = refuse (503), fail_open = local shares."
    )
    ledger_timeout_s: float = Field(
        0.25, gt=0, description="Bound on each Redis call; a slower reply counts as an outage (for 1 s)."
    )
    log_level: str = "info"
    # Output reservations (router.reservation, docs/reservations.md): max_tokens, or a learned quantile.
    reservation_mode: str = Field("max", description="max = prompt + max_tokens; predicted = learned.")
    reservation_target_preemption_rate: float = Field(
        0.01, gt=0, lt=1, description="predicted: bound on a rank outgrowing its pool, per placement."
    )
    reservation_quantile: float = Field(0.5, gt=0, lt=1, description="predicted: quantile reserved.")
    reservation_step_tokens: int = Field(
        64, ge=0, description="predicted: slack per growth, so page size 1 is not a ledger write per token."
    )
    reservation_bound: str = Field("normal", description="Over-commit headroom bound: normal or bernstein.")
    reservation_share_interval_s: float = Field(
        5.0, gt=0, description="predicted with redis_url: how often replicas exchange what they learned."
    )

    @field_validator("backends", "api_keys", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("ledger_failure_mode")
    @classmethod
    def _failure_mode(cls, value: str) -> str:
        return check_failure_mode(value if "_" in value or "-" in value else f"fail_{value}")

    @field_validator("ledger_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return check_namespace(value)

    @field_validator("reservation_mode")
    @classmethod
    def _reservation_mode(cls, value: str) -> str:
        return ReservationMode.parse(value).value

    @field_validator("reservation_bound")
    @classmethod
    def _reservation_bound(cls, value: str) -> str:
        bound = value.strip().lower()
        if bound not in BOUNDS:
            raise ValueError(f"unknown reservation bound {value!r} (known: {', '.join(BOUNDS)})")
        return bound

    @field_validator("backends")
    @classmethod
    def _valid_backends(cls, value: list[str]) -> list[str]:
        for i, text in enumerate(value):
            BackendSpec.parse(text, i)
        return value

    @model_validator(mode="after")
    def _one_ledger(self) -> Settings:
        """workers > 1 share one ledger: Redis when given, else a shared-memory file (router/ledger/shm.py)"""
        if self.ledger_path is not None and self.redis_url:
            raise ValueError(
                "ledger_path and redis_url are two ledgers: set one (Redis to share across hosts)"
            )
        if self.ledger_path is not None and self.workers == 1:
            raise ValueError("ledger_path is for workers > 1 (one worker keeps its ledger in process)")
        return self

    def shared_memory_ledger(self) -> bool:
        """Several workers and no Redis: the workers of this serve share a ledger file on this host."""
        return self.workers > 1 and not self.redis_url

    def backend_specs(self) -> list[BackendSpec]:
        return [BackendSpec.parse(text, i) for i, text in enumerate(self.backends)]

    def reservation_settings(self) -> ReservationSettings:
        return ReservationSettings(
            mode=ReservationMode.parse(self.reservation_mode),
            target_preemption_rate=self.reservation_target_preemption_rate,
            step_tokens=self.reservation_step_tokens,
            predictor=PredictorConfig(quantile=self.reservation_quantile),
            bound=self.reservation_bound,
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs: dict[str, Any] = getattr(init_settings, "init_kwargs", {})
        path = init_kwargs.get("config_file") or os.environ.get("KVROUTER_CONFIG") or None
        return (init_settings, env_settings, _ConfigFileSource(settings_cls, path))


def load_settings(**overrides: Any) -> Settings:
    """Settings from flags (``overrides``; None means "not given"), env and file, with one-line errors."""
    from pydantic import ValidationError

    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        message = str(err["msg"]).removeprefix("Value error, ")  # pydantic's prefix for a ValueError
        raise ConfigError(f"{where}: {message}") from None
