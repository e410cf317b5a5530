"""Decoding: sampling (greedy, temperature, min-p, top-k, top-p, penalties), beam search's bookkeeping, the
plain reference decoders, and batching helpers. Imports model/, never the service."""
