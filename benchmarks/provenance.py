"""Where a benchmark's figures came from: the commit they were measured at, written into its JSON."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checked-out commit, `-dirty` when the work tree differs from it ("unknown" outside a git checkout)."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    return described.stdout.strip() or "unknown"
