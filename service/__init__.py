"""The inference service: the engine (continuous batching) and the Ray Serve / HTTP layer above it."""
