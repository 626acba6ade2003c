"""The CPU backend (backend.py) and what only it uses: the native kernels (native.py, built from
csrc/ on first use), the linear layers on GGUF blocks (gguf.py) and on weight-only int8
(quant.py), and the decode stack (stack.py). Imports run one way: backend.py imports stack.py,
gguf.py and quant.py (stack.py imports gguf.py); all of them import native.py."""
from worker_svc.backends.cpu.backend import (
                                             AUTO_KV_DTYPE,
                                             NATIVE_FASTER,
                                             CpuBackend,
                                             NativeCpuAttention,
                                             NativeCpuMetadata,
                                             NativeCpuOps,
                                             NativeDecode,
                                             cpu_backend,
                                             native_ops_enabled,
)

__all__ = ["AUTO_KV_DTYPE", "NATIVE_FASTER", "CpuBackend", "NativeCpuAttention", "NativeCpuMetadata",
           "NativeCpuOps", "NativeDecode", "cpu_backend", "native_ops_enabled"]
