"""Continuous (iteration-level) batching over the models of `model/`. No Ray, no HTTP here."""
