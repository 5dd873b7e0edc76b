"""Pure-functional Llama-family model: param tree (params.py), layers, forward (transformer.py)."""
