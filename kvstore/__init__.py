"""Moving KV blocks out of and into a worker by key: the seam for prefill/decode
disaggregation and prefix offload. store.py is torch-free; transfer.py runs inside a worker."""
