"""Schemathesis against the running service's own OpenAPI schema: generated requests (bounded per
operation, deterministic) never get a 5xx, and every response has a declared status, the declared
content type and matches its schema, streams event by event (the request models' examples
include streams). The requests it sent are read back from its HAR record."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_no_generated_request_breaks_the_service(service_url: str, tmp_path: Path) -> None:
    har = tmp_path / "schemathesis.har"
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{service_url}/openapi.json",
        f"--checks={CHECKS}",
        "--max-examples=20",
        "--generation-deterministic",
        "--request-timeout=120",
        "--report=har",
        f"--report-har-path={har}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(entry["response"]["status"] for entry in entries)

    def route(entry: dict[str, Any]) -> tuple[str, str]:
        return entry["request"]["method"], entry["request"]["url"].split("?")[0].removeprefix(service_url)

    per_route = Counter(route(entry) for entry in entries)
    streams = Counter(route(entry) for entry in entries if entry["response"]["content"]["mimeType"].startswith("text/event-stream"))
    print(f"{len(entries)} requests; statuses {dict(statuses)}; {per_route.most_common(8)}; event streams {dict(streams)}")
    for work in [("POST", "/v1/completions"), ("POST", "/v1/translate"), ("POST", "/translate"), ("POST", "/detect")]:
        assert per_route[work] >= 5, work  # several generated examples for each route that does work
    assert streams[("POST", "/v1/completions")] and streams[("POST", "/v1/translate")]  # the schemas' examples stream
    assert not [status for status in statuses if status >= 500]
