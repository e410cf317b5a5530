"""The engine's deadlines sit inside Serve's: every config in deploy/ lets the engine end a
request (with its own clear status, freeing its slot) before Serve's request_timeout_s cuts it."""

from service.config import ServiceConfig
from tests.helpers import serve_configs


def test_engine_deadlines_end_requests_before_serve_times_them_out() -> None:
    for name, config in serve_configs().items():
        serve_timeout = config.get("http_options", {}).get("request_timeout_s")
        assert serve_timeout is not None, f"{name}: no request_timeout_s"
        for application in config["applications"]:
            parsed = ServiceConfig(**application["args"])
            for model in (parsed.translator, parsed.generator):
                total = model.engine.request_timeout_s
                assert total is not None and total < serve_timeout, f"{name} {model.name}: {total} vs Serve's {serve_timeout}"
                assert model.engine.queue_timeout_s is not None and model.engine.queue_timeout_s <= total
