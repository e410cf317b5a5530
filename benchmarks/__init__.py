"""In-process measurements of the models and the engine (no HTTP)."""
