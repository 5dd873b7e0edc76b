"""LoRA adapters (issue 31): reading PEFT directories and merging an adapter into the base
weights (`adapter.py`, the reference), and many adapters in one step from pools of slots
(`batched.py`: each token row its own adapter's delta)."""

from jaxserve.lora.adapter import (AdapterError, LoraAdapter, load_peft_adapter,  # noqa: F401
                                   merge_adapter)
from jaxserve.lora.batched import LoraSlots, empty_slots, lora_delta, put_adapter  # noqa: F401
