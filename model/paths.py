"""Where the shipped checkpoints live. Imports nothing heavy: the HTTP layer reads these defaults
without loading a tensor library."""

from pathlib import Path

CHECKPOINTS = Path(__file__).parent / "checkpoints"
DEFAULT_TRANSLATOR = CHECKPOINTS / "translator-en-de"
DEFAULT_TRANSLATOR_FR = CHECKPOINTS / "translator-en-fr"
DEFAULT_GENERATOR = CHECKPOINTS / "generator-shakespeare"
