"""Schema fuzzing: schemathesis drives every operation of the router's own OpenAPI document (valid and
invalid bodies, paths, headers) against a live router and emulator on loopback. Zero 5xx, every 4xx in
the OpenAI error shape, and the ledger back at zero afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from gateway_support import MODEL, emulator
from hypothesis import HealthCheck, settings
from test_hardening_support import ERROR_KEYS, RouterThread

from router.config import Settings
from router.gateway import create_app

# The document is the app's own; building the app opens nothing (resources belong to its lifespan).
SCHEMA = schemathesis.openapi.from_dict(create_app(Settings()).openapi())
MAX_EXAMPLES = 30
ADMIN = "fuzz-admin-token"


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    with (
        emulator(dp_size=2, kv_tokens_per_rank=8192, max_model_len=8192) as emu,
        RouterThread(backends=[f"sglang={emu.url}"], admin_token=ADMIN, queue_timeout_s=2) as router,
    ):
        yield router.url
        # Whatever was thrown at it, nothing is still held.
        rows = [
            r
            for b in httpx.get(router.url + "/ranks", headers=_auth()).json()["backends"]
            for r in b["ranks"]
        ]
        assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows), rows
        assert httpx.get(emu.url + "/_emulator/stats").json()["inflight"] == 0


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


@SCHEMA.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=5000,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_no_server_errors_anywhere(case: schemathesis.Case, live: str) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # random names only reach the 404; the served one reaches the engine
    if case.path.startswith("/ranks/") and len(str(case.path_parameters)) % 2:
        case.headers = {**(case.headers or {}), **_auth()}  # half the admin calls authenticated
    response = case.call(base_url=live, timeout=10)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400 and response.status_code != 405:
        err = response.json()["error"]
        assert set(err) == ERROR_KEYS, err
