"""Training and evaluation: data, the training loop, BLEU and likelihood, curves, checkpoint
averaging. Never imported by the service."""
