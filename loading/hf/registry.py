"""Every Hugging Face architecture served, by the name config.json's "architectures" gives it: the one
table loading/folder.py (a folder's kind) and loading/hf/load.py (its model) read."""

from typing import Any

from loading.hf.adapter import Adapter
from loading.hf.gpt_neox import GPT_NEOX
from loading.hf.llama import LLAMA
from loading.hf.marian import MARIAN

ADAPTERS: dict[str, Adapter[Any]] = {name: adapter for adapter in (MARIAN, GPT_NEOX, LLAMA) for name in adapter.architectures}
# Architectures people bring that are not served yet, with what to say.
NOT_YET_SUPPORTED = (
    "T5ForConditionalGeneration",
    "BartForConditionalGeneration",
    "M2M100ForConditionalGeneration",
    "GemmaForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
