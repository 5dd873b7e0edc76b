"""LoRA adapters (issue 31): reading PEFT directories and merging an adapter into the base
weights (`adapter.py`)."""

from jaxserve.lora.adapter import (AdapterError, LoraAdapter, load_peft_adapter,  # noqa: F401
                                   merge_adapter)
