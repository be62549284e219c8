"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis): no 5xx, no crash."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from support.live_server import LiveServer, requires_bwrap

pytestmark = requires_bwrap


def _fuzz(max_examples: int) -> None:
    server = LiveServer("--max-sessions", "8")
    try:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers)
        failures = []
        http = server.client()
        live = [http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]]
        for operation in schema.get_all_operations():
            if isinstance(operation, Err):
                raise operation.err()
            op = operation.ok()

            @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def check(case):
                # Half the cases target a live session, so tool calls and grading get exercised.
                if case.path_parameters and "session_id" in case.path_parameters and len(str(case.body)) % 2:
                    case.path_parameters["session_id"] = live[0]
                response = case.call(headers={"Authorization": f"Bearer {server.token}"}, timeout=60)
                try:
                    case.validate_response(response, checks=[not_a_server_error])
                except Exception as exc:  # noqa: BLE001 - collect, then report all at once
                    # check() runs at once below, inside this iteration: op is the current one
                    failures.append(f"{op.method.upper()} {op.path}: {exc}"[:500])  # noqa: B023
                if op.method.upper() == "DELETE" and response.status_code == 200:  # noqa: B023
                    live[0] = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]

            check()
        assert server.proc.poll() is None, "the server crashed"
        assert not failures, "\n".join(failures[:10])
    finally:
        server.stop()


def test_fuzz_api_fast():
    _fuzz(max_examples=12)  # every operation; test_fuzz_api_thorough (slow) runs 300 each


@pytest.mark.slow
def test_fuzz_api_thorough():
    _fuzz(max_examples=300)
