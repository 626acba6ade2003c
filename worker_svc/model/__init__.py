"""The Llama-family model: RoPE (rope.py), TP-ready linear layers (linear.py) and the
transformer over a flat hybrid batch (llama.py). The model uses the device backends
(worker_svc.backends), never the reverse; the data types both read, the architecture
(worker_svc.model_config) and GGUF weight blocks (worker_svc.gguf_blocks), sit below both."""
