"""LoRA adapters (issue 31): reading PEFT directories and merging an adapter into the base
weights (`adapter.py`, the reference; plain Python + numpy, what the engine's host side
keeps), many adapters in one step from pools of slots (`batched.py`: each token row its
own adapter's delta, JAX) and what a request names (`request.py`)."""

from jaxserve.lora.adapter import (AdapterError, LoraAdapter, load_peft_adapter,  # noqa: F401
                                   merge_adapter)
from jaxserve.lora.request import LoRARequest  # noqa: F401
