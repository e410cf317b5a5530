"""Dependencies point one way: model/ <- service/engine/ <- the HTTP and Ray layers."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0] if not node.module.startswith("service.") else node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_model_imports_neither_service_nor_serving_frameworks() -> None:
    for path, names in imported_modules("model").items():
        assert not names & {"service", "ray", "fastapi", "pydantic"}, path


def test_engine_imports_no_ray_fastapi_or_pydantic() -> None:
    for path, names in imported_modules("service/engine").items():
        assert not names & {"ray", "fastapi", "starlette", "pydantic"}, path
        assert not any(n.startswith("service.") and not n.startswith("service.engine") for n in names), path


def test_http_layer_does_not_import_ray() -> None:
    for path, names in imported_modules("service/api").items():
        assert "ray" not in names, path
