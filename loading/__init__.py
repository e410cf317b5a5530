"""Checkpoints and what reads them: our format, Hugging Face folders (one adapter per
architecture, hf/), tokenizers, chat templates and the tool-call formats they ask for."""
