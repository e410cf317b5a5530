"""The Transformer from first principles: layers, the two models, tokenizers, checkpoints, training."""
