"""Schemathesis over the server's own /openapi.json: generated requests, valid and invalid, to every
route of a real server. None may get a 5xx, and every error body must be OpenAI's shape."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from ..helpers import TEST_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # schemathesis sends hundreds of generated requests

API_KEY = "fuzz-key"
# Short contexts and a short queue keep generated requests cheap: most are refused at once, the
# rest generate a few tokens.
FUZZ_ARGS = [
    "--dtype",
    TEST_ENGINE_ARGS["dtype"],
    "--max-model-len",
    "64",
    "--kv-cache-memory-bytes",
    "64MiB",
    "--disable-log-stats",
    "--max-num-seqs",
    "4",
    "--max-queue-len",
    "8",
    "--api-key",
    API_KEY,
]


@pytest.fixture(scope="module")
def api_schema():
    server = RemoteServer(FUZZ_ARGS)
    yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    server.stop()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_no_request_gets_a_5xx_and_every_error_is_openai_shaped(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    if mode == schemathesis.GenerationMode.NEGATIVE:  # only bodies can be invalid here
        operations = [op for op in operations if op.method.upper() == "POST"]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
            where = f"{case.method} {case.path} {case.body!r:.300}"
            assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text}"
            if response.status_code >= 400:
                body = response.json()
                assert set(body) == {"error"}, f"{where} -> {body}"
                assert set(body["error"]) == {"message", "type", "param", "code"}, f"{where} -> {body}"

        check()
