"""The CUDA backend (backend.py) and what only it uses: FlashInfer's per-batch metadata
(flashinfer_meta.py), CUDA graphs for decode batches (cuda_graphs.py) and KV sizing from device
memory (kv_sizing.py); it samples on the device with worker_svc.sampling.DeviceFirstSampler. Importing this package does
not import flashinfer: only building a FlashInfer attention backend does."""
from worker_svc.backends.cuda.backend import (
                                              CudaBackend,
                                              FlashInferAttention,
                                              FlashInferMetadata,
                                              cuda_backend,
                                              flashinfer_unavailable_reason,
)

__all__ = ["CudaBackend", "FlashInferAttention", "FlashInferMetadata", "cuda_backend",
           "flashinfer_unavailable_reason"]
