"""The Llama-family model: config parsing (config.py), RoPE (rope.py), TP-ready linear layers
(linear.py) and the transformer over a flat hybrid batch (llama.py)."""
