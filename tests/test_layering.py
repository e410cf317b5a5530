"""Dependencies point one way: model/ (the Transformer's modules) <- loading/ (checkpoints,
tokenizers, chat templates) <- decoding/ <- service/engine/ <- the HTTP and Ray layers; exports/
and training/ sit on top, and nothing that serves imports them. Of service/, exports/ and training/
import the engine alone: they decode through it in-process (service/engine/offline.py), so that
the scores they report are the served engine's; never the HTTP or Ray layers."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Every module each file imports, by full dotted name (relative imports resolved)."""
    found: dict[str, set[str]] = {}
    for path in (root / package).rglob("*.py"):
        names: set[str] = set()
        own_package = path.relative_to(root).parent.parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = own_package[: len(own_package) - node.level + 1] if node.level else ()
                names.add(".".join([*base, *([node.module] if node.module else [])]))
        found[str(path.relative_to(root))] = names
    return found


def imports_any(names: set[str], packages: set[str]) -> bool:
    """Whether any of names is one of packages or inside one."""
    return any(n == p or n.startswith(p + ".") for n in names for p in packages)


OURS = {"model", "loading", "decoding", "exports", "training", "service", "benchmarks", "loadtests"}
# Each package's own imports among OURS (besides itself): what sits below it, a package or a part
# of one (service.engine: the engine without the HTTP and Ray layers of service/).
BELOW = {
    "model": set(),
    "loading": {"model"},
    "decoding": {"model", "loading"},
    "exports": {"model", "loading", "decoding", "service.engine"},
    "training": {"model", "loading", "decoding", "exports", "service.engine"},
}


def test_model_imports_neither_service_nor_serving_frameworks() -> None:
    for path, names in imported_modules("model").items():
        assert not imports_any(names, {"service", "ray", "fastapi", "pydantic"}), path


def test_each_package_imports_only_the_packages_below_it() -> None:
    for package, below in BELOW.items():
        for path, names in imported_modules(package).items():
            ours = {n for n in names if imports_any({n}, OURS)}
            assert all(imports_any({n}, below | {package}) for n in ours), (path, ours)


def test_training_and_exports_reach_the_engine_but_not_the_http_or_ray_layers() -> None:
    """The offline front loads the engine, and neither Ray nor the HTTP stack comes with it."""
    watched = ("service.engine.offline", "ray", "fastapi", "starlette", "service.app", "service.api")
    imports = "import sys, training.evaluate, training.train, exports.export, exports.ship"
    probe = f"{imports}; print(sorted(m for m in {watched} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "['service.engine.offline']"


def test_nothing_that_serves_imports_training_evaluation_or_exports() -> None:
    """The engine, the HTTP layer and the Ray layer (and what they import below them)."""
    for package in ("service", "model", "loading", "decoding"):
        for path, names in imported_modules(package).items():
            assert not imports_any(names, {"training", "exports"}), path


def test_engine_imports_no_ray_fastapi_pydantic_or_upper_layers() -> None:
    for path, names in imported_modules("service/engine").items():
        assert not imports_any(names, {"ray", "fastapi", "starlette", "pydantic"}), path
        assert not any(imports_any({n}, {"service"}) and not imports_any({n}, {"service.engine"}) for n in names), path


def test_http_layer_does_not_import_ray() -> None:
    for path, names in imported_modules("service/api").items():
        assert not imports_any(names, {"ray"}), path


def test_the_check_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "service" / "engine").mkdir(parents=True)
    (tmp_path / "service" / "engine" / "a.py").write_text("import service.api.app\nfrom ..config import X\n")
    assert imported_modules("service/engine", tmp_path)["service/engine/a.py"] == {"service.api.app", "service.config"}


def test_the_protocol_imports_no_framework_and_no_tensor_library() -> None:
    # The engine's shared words and what a request asks of sampling: both torch-free.
    names = imported_modules("service")["service/protocol.py"] - {"service.engine.config", "decoding.sampling_params"}
    assert not imports_any(names, {"ray", "fastapi", "starlette", "pydantic", "torch", "numpy", "service", "model"}), names


def test_the_ingress_process_loads_no_tensor_library() -> None:
    """What Ray imports in the ingress replica (service.ingress, by the class's module) and the
    HTTP app it serves leave torch unloaded: a process that only routes HTTP stays small."""
    probe = "import sys, service.ingress, service.api.app; print(sorted(m for m in ('torch', 'service.engine.engine') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
