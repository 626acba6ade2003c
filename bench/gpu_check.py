"""One command on a CUDA machine: install FlashInfer if missing, run the GPU tests, run the GPU
benchmark, and leave the results to commit in bench/results/gpu/.

    python -m bench.gpu_check [--flashinfer PATH.tar.gz|PATH.whl] [--rounds 5] [--dry-run]

Steps (each a subprocess from the repository root; output also saved under bench/results/gpu/):
1. environment: GPU, driver, CUDA, torch, Python -> gpu_check_env.txt;
2. FlashInfer: kept if it imports; else installed from --flashinfer (a local sdist or wheel, the
   recipe of ../shared/GPU.md for a machine without a package index: pip --no-index --no-deps
   --no-build-isolation --target .gpu_deps) or, with --pip, from the index (flashinfer-python);
3. the GPU tests (pytest -m gpu) -> gpu_tests.txt; FlashInfer JIT-compiles its kernels on first
   use (~2 min on 16 cores), so they run before the benchmark;
4. the benchmark, FlashInfer + CUDA graphs (bench.gpu_engine_iteration) -> gpu_engine_iteration.*,
   and the torch attention path without graphs (the "before") -> gpu_engine_iteration_torch.*.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu"
DEPS = ROOT / ".gpu_deps"          # where a local FlashInfer sdist/wheel is installed (git-ignored)

ENV_SCRIPT = ("import platform, torch, subprocess; print('python', platform.python_version()); "
              "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
              "print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None); "
              "print(subprocess.run(['nvidia-smi'], capture_output=True, text=True).stdout)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flashinfer", type=Path, help="local flashinfer-python sdist (.tar.gz) or wheel")
    ap.add_argument("--pip", action="store_true", help="install flashinfer-python from the package index")
    ap.add_argument("--rounds", type=int, default=5, help="benchmark rounds (median reported)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch-path benchmark")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    args = ap.parse_args(argv)
    if args.flashinfer is not None and args.pip:
        ap.error("--flashinfer and --pip are alternatives")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def flashinfer_importable(python: str = sys.executable) -> bool:
    return subprocess.run([python, "-c", "import flashinfer"], env=child_env(),
                          capture_output=True).returncode == 0


def plan(args: argparse.Namespace, have_flashinfer: bool,
         python: str = sys.executable) -> list[tuple[str, list[str], Path | None]]:
    """(name, argv, log file) of each step, in order."""
    steps: list[tuple[str, list[str], Path | None]] = [
        ("environment", [python, "-c", ENV_SCRIPT], RESULTS / "gpu_check_env.txt")]
    if not have_flashinfer:
        if args.flashinfer is not None:
            steps.append(("install flashinfer (local)", [
                python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                "--target", str(DEPS), str(args.flashinfer)], None))
        elif args.pip:
            steps.append(("install flashinfer (index)", [python, "-m", "pip", "install", "flashinfer-python"], None))
    if not args.skip_tests:
        steps.append(("GPU tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                    "-rs", "tests/"], RESULTS / "gpu_tests.txt"))
    if not args.skip_bench:
        steps.append(("benchmark: FlashInfer + CUDA graphs", [
            python, "-m", "bench.gpu_engine_iteration", "--rounds", str(args.rounds),
            "--out", "bench/results/gpu/gpu_engine_iteration"], RESULTS / "gpu_engine_iteration.log"))
        if not args.no_baseline:
            steps.append(("benchmark: torch attention path, no graphs (before)", [
                python, "-m", "bench.gpu_engine_iteration", "--rounds", str(args.rounds),
                "--attention", "torch", "--no-cuda-graphs", "--no-profile",
                "--out", "bench/results/gpu/gpu_engine_iteration_torch"], RESULTS / "gpu_engine_iteration_torch.log"))
    return steps


def child_env() -> dict[str, str]:
    """PYTHONPATH = the repository root (+ the local FlashInfer install, when there is one)."""
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(DEPS)] if DEPS.is_dir() else []) + \
        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_step(name: str, argv: list[str], log: Path | None) -> int:
    print(f"\n=== {name}: {shlex.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:          # show progress as it comes, keep it for the log
        sys.stdout.write(line)
        lines.append(line)
    rc = proc.wait()
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {shlex.join(argv)}\n" + "".join(lines) + f"\n(exit {rc})\n")
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for name, cmd, log in plan(args, have_flashinfer=False):
            print(f"{name}: {shlex.join(cmd)}" + (f"  > {log.relative_to(ROOT)}" if log else ""))
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine",
              file=sys.stderr)
        return 2
    have = flashinfer_importable()
    if not have and args.flashinfer is None and not args.pip:
        print("gpu_check: flashinfer is not importable; pass --flashinfer PATH (sdist or wheel) or --pip",
              file=sys.stderr)
        return 2
    failed = []
    for name, cmd, log in plan(args, have):
        if run_step(name, cmd, log) != 0:
            failed.append(name)
            if name.startswith("install"):
                break
    print("\n=== gpu_check: " + ("all steps passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
