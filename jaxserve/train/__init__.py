"""Training on jaxserve's own functional model (`lora.py`: a LoRA adapter fine-tuned with
optax on `jaxserve.functional.score`, written in PEFT's format for the server to load).

May import: the layers below the engine (jaxserve.functional, jaxserve.model,
jaxserve.lora, jaxserve.checkpoint, jaxserve.tokenization, jaxserve.config)."""
