"""Build the native CPU kernels at install time, one shared library per instruction-set level.

Everything else about the package is in pyproject.toml. The kernels are plain C compiled with
setuptools' build_ext (worker_svc/backends/cpu/kernel_sources.py says which sources, flags and
variants, and why); the libraries are loaded with ctypes, so they have no Python C API and one
build serves every CPython 3 (py_limited_api: the abi3 suffix). The sources of a variant compile in parallel.

SARATHI_KERNELS_VARIANTS=avx2,portable builds a subset, =auto the variants this CPU runs (`make
install`: a quicker development install); the default (a wheel, an image) is every variant of
this machine's architecture. Without a C compiler the install fails
with the compiler's message (the worker would otherwise run the slow torch path unnoticed).
"""
import importlib.util
import os
import shlex
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kernel_sources", HERE / "worker_svc/backends/cpu/kernel_sources.py")
ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ks)


class BuildKernels(build_ext):
    """build_ext for the kernel libraries: the sources of a variant compile side by side (one
    compiler process per core; distutils' compile() runs them one at a time), each variant into
    its own temporary folder (the variants share source names), then link with -shared. The
    compiler is $CC, else Python's own (sysconfig), else gcc."""

    def build_extension(self, ext):
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "gcc")
        temp = Path(self.build_temp) / ext.name
        temp.mkdir(parents=True, exist_ok=True)
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        objects = [str(temp / (Path(src).stem + ".o")) for src in ext.sources]

        def run(cmd):
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(run, ([*cc, *ext.extra_compile_args, "-c", src, "-o", obj]
                                for src, obj in zip(ext.sources, objects))))
        run([*cc, "-shared", *objects, *ext.extra_link_args, "-o", str(out)])


def extensions():
    digest = ks.source_hash()
    wanted = os.environ.get("SARATHI_KERNELS_VARIANTS")
    if wanted == "auto":
        wanted = ",".join(ks.runnable_variants(ks.cpu_flags()))   # the variants this CPU runs
    out = []
    for name, (flags, _) in ks.variants().items():
        if wanted and name not in wanted.split(","):
            continue
        out.append(Extension(
            f"worker_svc.backends.cpu._kernels_{name.replace('-', '_')}",
            sources=[str(p.relative_to(HERE)) for p in ks.SOURCES],
            depends=[str(p.relative_to(HERE)) for p in ks.headers()],
            extra_compile_args=[*ks.COMMON_FLAGS, *flags, *ks.defines(name, digest)],
            extra_link_args=["-fopenmp", "-s"],
            py_limited_api=True))
    return out


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildKernels},
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
