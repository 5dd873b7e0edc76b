"""What a request names to run with an adapter (vLLM's LoRARequest)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for `jaxserve.LLM.generate` (vLLM's `LoRARequest`, the same
    positional fields): lora_name, what it is served as; lora_int_id, vLLM's unique
    number (accepted, unused: jaxserve keys adapters by name); lora_path, its PEFT
    directory, loaded the first time the name is used."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
