"""Hugging Face folders read exactly into our modules, and our models written back as such folders;
no transformers model runs.

One adapter per architecture family (marian.py: MarianMTModel; gpt_neox.py: GPTNeoXForCausalLM;
llama.py: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) declares what it reads and how
(adapter.py); registry.py lists them for loading/folder.py (a folder's kind) and load.py (its
weights), and exports/export.py writes through the same tables backwards.
"""
