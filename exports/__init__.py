"""Exports: our checkpoints as Hugging Face folders and CTranslate2 models, and the shipped
checkpoints' 16-bit storage. Never imported by the service."""
