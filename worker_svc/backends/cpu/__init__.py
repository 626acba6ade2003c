"""The CPU backend (backend.py) and what only it uses: the native kernels (native.py, built from
csrc/ on first use) and the weight-only int8 linear layers (quant.py)."""
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
