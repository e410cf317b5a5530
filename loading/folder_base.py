"""What loading/folder.py and the Hugging Face adapters (loading/hf/) share: the kinds of model a folder
holds, the error that says why a folder cannot be served, and reading its JSON files. Imports
nothing heavy: the HTTP layer reads folders without loading a tensor library."""

import json
from pathlib import Path
from typing import Any, Literal

ModelKind = Literal["translator", "generator"]


class CheckpointError(ValueError):
    """A folder that cannot be served; str() is one line naming the file and the problem."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from path, or CheckpointError saying why not."""
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "not a JSON object")
    return data
