"""One command on a CUDA machine: install what is missing, run the GPU tests, serve, benchmark,
and leave the results to commit in bench/results/gpu/, all within a hard time budget.

    python -m bench.gpu_check [--bundle .gpu_bundle] [--copy-to DIR] [--budget 480] [--dry-run]

Made for a GPU machine lent for a few minutes with no package index: `make gpu-bundle` (on any
machine with one) writes the bundle (bench.gpu_bundle), which travels with the repository.

Steps, in order (each a subprocess from the repository root, its output in bench/results/gpu/):
 1. install: the bundle's wheels with `pip install --no-index --no-deps --target`, unless the
    packages already import (a machine with an index: `pip install '.[gpu,test]'` instead);
 2. environment: GPU, driver, CUDA, torch, Python, and the copy bandwidth and bf16 GEMM rate
    measured here, the ceilings every bound below uses (gpu_check_env.json);
 3. imports: every product module imports (gpu_imports.json);
 4. FlashInfer's JIT build (about 2 min on 16 cores), in the background on all cores but two,
    while on those two the torch attention path without graphs is benchmarked (the baseline:
    gpu_engine_iteration_torch.*; GPU-bound, its host thread has its own core);
 5. the GPU tests, `pytest -m gpu` (gpu_tests.txt);
 6. the benchmark, FlashInfer + CUDA graphs + fused elementwise kernels, the default
    (gpu_engine_iteration.*, with a kernel profile and the host / GPU split of decode steps),
    and again with the reference elementwise ops (SARATHI_CUDA_OPS=torch:
    gpu_engine_iteration_torch_ops.*);
 7. `sarathi serve --device cuda` answering the openai client (gpu_serve_check.*);
 8. one load point per policy (and sarathi with async scheduling), real engine vs the
    simulator's H100 model (gpu_load_point.*);
 9. step 7 again with `sarathi serve --async-scheduling` (gpu_serve_check_async.*).

Each step's timeout is what is left of --budget (and at most its own cap); a step that does not
fit is skipped and says so. After every step the results folder and the step logs are packed
into --copy-to (gpu_check_results.tar.gz, with gpu_check.json: each step's exit code and
seconds), so a run cut off at any point still returns what it reached; FlashInfer's compiled
kernels go there too (flashinfer_jit.tar.gz) and --jit-cache takes them back on a rerun.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu"
DEFAULT_BUNDLE = ROOT / ".gpu_bundle"
SITE = ROOT / ".gpu_deps"            # where the bundle is installed (git-ignored)
JIT_BASE = ROOT / ".gpu_deps" / "flashinfer-workspace"   # FLASHINFER_WORKSPACE_BASE
NEEDED_MODULES = ("fastapi", "uvicorn", "pydantic", "redis", "zmq", "gguf", "llguidance", "openai",
                  "flashinfer")
JIT_ARCHIVE_LIMIT = 15 * 2**20       # a file that comes back from the device machine is <= 16 MiB

ENV_SCRIPT = r"""
import json, platform, subprocess, sys, time, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True)
info["nvidia_smi"] = smi.stdout.strip()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}")
    def timed(fn, n):
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record(); torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / n
    a = torch.empty(2**31, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
    info["copy_tbs"] = round(2 * a.numel() / timed(lambda: b.copy_(a), 10) / 1e12, 3)   # read + write
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); y = torch.randn_like(x)
    info["bf16_gemm_tflops"] = round(2 * 8192**3 / timed(lambda: x @ y, 10) / 1e12, 1)
print(json.dumps(info, indent=1))
"""

JIT_WARMUP = r"""
import time, torch, threading
from concurrent.futures import ThreadPoolExecutor
import flashinfer
from worker_svc.backends.cuda.backend import FlashInferAttention
from worker_svc.backends.cuda.flashinfer_meta import build_paged_batch
t0 = time.perf_counter()
dev = torch.device("cuda", 0)
att = FlashInferAttention(dev, torch.bfloat16)
att.bind(32, 8, 128, torch.bfloat16, 128 ** -0.5, 64)
lock = threading.Lock()

def attention(decode):
    k = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16, device=dev); v = torch.zeros_like(k)
    seqs = [(16, 1, [0, 1]), (5, 1, [2])] if decode else [(0, 20, [0, 1]), (16, 1, [2, 3])]
    pb = build_paged_batch(seqs, 16)
    wrapper = att.decode if decode else att.prefill
    with lock:                       # the two wrappers share one workspace: plan and run one at a time
        att.plan(wrapper, pb)
        q = torch.randn(pb.num_tokens, 32, 128, dtype=torch.bfloat16, device=dev)
        wrapper.run(q, (k, v)); torch.cuda.synchronize()
    return "decode" if decode else "prefill"

def build(name, get):
    get()                            # JIT: compile (or find) and load the module
    return name

jobs = [lambda: attention(False), lambda: attention(True),
        lambda: build("norm", flashinfer.norm.get_norm_module),
        lambda: build("silu_and_mul", lambda: flashinfer.activation.get_act_and_mul_module("silu")),
        lambda: build("rope", flashinfer.rope.get_rope_module)]
with ThreadPoolExecutor(len(jobs)) as pool:
    for f in [pool.submit(j) for j in jobs]:
        print(f.result(), "kernels ready after", round(time.perf_counter() - t0, 1), "s", flush=True)
"""


@dataclass
class Step:
    """name; argv(context) -> the command; log file under RESULTS; cap: most seconds it may take;
    need: the least seconds worth starting it with; cpus: 'fore' (two cores) / 'back' (the rest)
    while the JIT build runs in the background, None = all."""

    name: str
    argv: Callable[[dict], list[str]]
    log: str
    cap: float
    need: float = 20.0
    cpus: str | None = None
    background: bool = False
    optional: bool = False
    result: dict = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE,
                    help="the folder `make gpu-bundle` writes (wheels/, model/)")
    ap.add_argument("--copy-to", type=Path, help="also pack results and logs here after every step")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (hard)")
    ap.add_argument("--jit-cache", type=Path, help="flashinfer_jit.tar.gz from an earlier run (skips the build)")
    ap.add_argument("--rounds", type=int, default=5, help="benchmark rounds (median reported)")
    ap.add_argument("--skip", default="", help="comma-separated step names to leave out")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.budget <= 0:
        ap.error("--budget must be > 0 seconds")
    return args


def child_env() -> dict[str, str]:
    """PYTHONPATH = the repository root + the installed bundle; FlashInfer's JIT output in a
    known folder (so it can be packed and brought back)."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["FLASHINFER_WORKSPACE_BASE"] = str(JIT_BASE)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def missing_modules(python: str = sys.executable) -> list[str]:
    code = ("import importlib.util as u, sys; "
            f"print(' '.join(m for m in {NEEDED_MODULES!r} if u.find_spec(m) is None))")
    r = subprocess.run([python, "-c", code], env=child_env(), capture_output=True, text=True)
    return r.stdout.split()


def steps(args: argparse.Namespace, python: str = sys.executable) -> list[Step]:
    """Every step in order (see module docstring); argv is built when the step starts, from what
    earlier steps found (ctx: the measured rates)."""
    out = "bench/results/gpu/"

    def rates(ctx: dict) -> list[str]:
        env = ctx.get("env", {})
        r = []
        if env.get("copy_tbs"):
            r += ["--hbm-tbs", str(env["copy_tbs"])]
        if env.get("bf16_gemm_tflops"):
            r += ["--dense-tflops", str(env["bf16_gemm_tflops"])]
        return r

    wheels = sorted(str(p) for p in (args.bundle / "wheels").glob("*.whl")) if args.bundle else []
    bench = [python, "-m", "bench.gpu_engine_iteration", "--rounds", str(args.rounds)]
    all_steps = [
        Step("install", lambda ctx: [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                     "--upgrade", "--target", str(SITE), *wheels], "gpu_install.log", 120),
        Step("environment", lambda ctx: [python, "-c", ENV_SCRIPT], "gpu_check_env.json", 60),
        Step("imports", lambda ctx: [python, "-c", _import_all()], "gpu_imports.json", 90),
        Step("flashinfer-jit", lambda ctx: [python, "-c", JIT_WARMUP], "gpu_flashinfer_jit.log", 300,
             cpus="back", background=True),
        Step("baseline", lambda ctx: [*bench, "--attention", "torch", "--no-cuda-graphs", "--no-profile", *rates(ctx),
                                      "--out", out + "gpu_engine_iteration_torch"],
             "gpu_engine_iteration_torch.log", 150, need=40, cpus="fore"),
        Step("tests", lambda ctx: [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
                                   "--timeout", "240", "tests/gpu"], "gpu_tests.txt", 240, need=40),
        Step("benchmark", lambda ctx: [*bench, *rates(ctx), "--out", out + "gpu_engine_iteration"],
             "gpu_engine_iteration.log", 150, need=40),
        Step("benchmark-torch-ops", lambda ctx: [*bench, *rates(ctx), "--ops", "torch",
                                                 "--out", out + "gpu_engine_iteration_torch_ops"],
             "gpu_engine_iteration_torch_ops.log", 150, need=40),
        Step("serve", lambda ctx: [python, "-m", "bench.gpu_serve_check", "--model-files",
                                   str(args.bundle / "model"), "--out", out + "gpu_serve_check"],
             "gpu_serve_check.log", 150, need=45),
        Step("load", lambda ctx: [python, "-m", "bench.gpu_load_point", "--policies", "sarathi,vllm,sarathi+async",
                                  "--out", out + "gpu_load_point"],
             "gpu_load_point.log", 200, need=60),
        Step("serve-async", lambda ctx: [python, "-m", "bench.gpu_serve_check", "--model-files",
                                         str(args.bundle / "model"), "--async-scheduling",
                                         "--out", out + "gpu_serve_check_async"],
             "gpu_serve_check_async.log", 120, need=45),
    ]
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {s.name for s in all_steps}
    if unknown:
        raise SystemExit(f"gpu_check: unknown step(s) to skip: {', '.join(sorted(unknown))}")
    if not wheels:
        skip.add("install")
    return [s for s in all_steps if s.name not in skip]


def _import_all() -> str:
    from bench.gpu_bundle import IMPORT_ALL
    return IMPORT_ALL


def cpu_sets() -> dict[str, set[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        return {"fore": set(cpus), "back": set(cpus)}
    return {"fore": set(cpus[:2]), "back": set(cpus[2:])}


@dataclass
class Running:
    step: Step
    proc: subprocess.Popen
    log: object
    t0: float
    timeout: float


class Runner:
    """Runs steps against one deadline, records each in gpu_check.json, packs after each."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        # the machine's own --copy-to folder is $OUT on the device tool: recorded as that, so the
        # committed record names no path of the machine it ran on
        argv = ["$OUT" if args.copy_to and a == str(args.copy_to) and os.path.isabs(a) else a for a in sys.argv[1:]]
        self.record: dict = {"command": "python -m bench.gpu_check " + " ".join(argv),
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                             "budget_s": args.budget, "steps": []}
        self.ctx: dict = {}
        self.cpus = cpu_sets()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, step: Step) -> Running | None:
        """Start step (None: it does not fit in what is left of the budget). A background step
        writes straight to its log file (no pipe to fill while nobody reads it)."""
        left = self.left() - 5
        if left < step.need:
            self.note(step, None, 0.0, f"skipped: {left:.0f} s left, needs {step.need:.0f}")
            return None
        argv = step.argv(self.ctx)
        print(f"\n=== [{time.monotonic() - self.t0:5.0f} s] {step.name}: {shlex.join(argv)[:400]}", flush=True)
        cpus = self.cpus.get(step.cpus) if step.cpus else None
        log = open(RESULTS / step.log, "w")
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=log if step.background else subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        return Running(step, proc, log, time.monotonic(), min(step.cap, left))

    def finish(self, run: Running) -> int:
        """Until exit or timeout (then the process group is killed): a foreground step's output
        goes to the console and its log line by line; a background step's log is shown at the end."""
        import selectors
        import signal

        end = run.t0 + run.timeout
        timed_out = False
        if run.step.background:
            try:
                run.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        else:
            sel = selectors.DefaultSelector()
            sel.register(run.proc.stdout, selectors.EVENT_READ)
            while True:
                if time.monotonic() > end:
                    timed_out = True
                    break
                if sel.select(timeout=1.0):
                    line = run.proc.stdout.readline()
                    if not line:
                        break
                    run.log.write(line)
                    sys.stdout.write(line)
                    sys.stdout.flush()
        if timed_out:
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rc = run.proc.wait()
        run.log.close()
        if run.step.background:
            sys.stdout.write((RESULTS / run.step.log).read_text()[-4000:])
        rc = 124 if timed_out else rc
        status = f"timed out after {run.timeout:.0f} s" if timed_out else f"exit {rc}"
        self.note(run.step, rc, time.monotonic() - run.t0, status)
        return rc

    def note(self, step: Step, rc: int | None, seconds: float, status: str) -> None:
        step.result = {"name": step.name, "rc": rc, "seconds": round(seconds, 1), "status": status}
        self.record["steps"].append(step.result)
        print(f"=== {step.name}: {status} ({seconds:.0f} s; {self.left():.0f} s of the budget left)", flush=True)
        self.save()

    def save(self) -> None:
        self.record["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (RESULTS / "gpu_check.json").write_text(json.dumps(self.record, indent=1))
        if self.args.copy_to:
            pack(self.args.copy_to / "gpu_check_results.tar.gz")

    def run_step(self, step: Step) -> int | None:
        run = self.start(step)
        return None if run is None else self.finish(run)


def pack(path: Path) -> None:
    """bench/results/gpu/ into one archive (written next to itself, then renamed: atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(RESULTS.rglob("*")):
            if p.is_file():
                tar.add(p, arcname=str(Path("bench/results/gpu") / p.relative_to(RESULTS)))
    tmp.replace(path)


def pack_jit(path: Path) -> int:
    """FlashInfer's compiled kernels (*.so and their build files), if they fit one file back."""
    if not JIT_BASE.is_dir():
        return 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(JIT_BASE.rglob("*")):
            if p.is_file() and (p.suffix in (".so", ".ninja") or p.name == "build.ninja"):
                tar.add(p, arcname=str(p.relative_to(JIT_BASE)))
    data = buf.getvalue()
    if len(data) > JIT_ARCHIVE_LIMIT:
        print(f"gpu_check: compiled kernels are {len(data) / 2**20:.1f} MiB packed; not kept", flush=True)
        return 0
    path.write_bytes(data)
    return len(data)


def aot_dir(python: str = sys.executable) -> Path | None:
    """FlashInfer's folder of prebuilt modules (<package>/data/aot), None without FlashInfer."""
    r = subprocess.run([python, "-c", "import flashinfer, os; print(os.path.dirname(flashinfer.__file__))"],
                       env=child_env(), capture_output=True, text=True)
    return Path(r.stdout.strip().splitlines()[-1]) / "data" / "aot" if r.returncode == 0 else None


def install_jit_cache(source: Path, python: str = sys.executable) -> list[str]:
    """Compiled kernels, from an earlier run's archive (pack_jit) or from this run's JIT folder,
    as FlashInfer's prebuilt ("AOT") modules: <package>/data/aot/<name>/<name>.so, which every
    later process loads as they are. A JIT module is otherwise rechecked by ninja in every new
    process, and rebuilt there whenever the installed sources look newer than the object (seen
    on the GPU machine: ~20-35 s per module at each worker start)."""
    aot = aot_dir(python)
    if aot is None:
        return []
    names = []

    def put(name: str, data: bytes) -> None:
        dest = aot / name / f"{name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        names.append(name)

    if source.is_dir():
        for p in sorted(source.rglob("*.so")):
            if p.parent.name == p.stem:
                put(p.stem, p.read_bytes())
    else:
        with tarfile.open(source) as tar:
            for m in tar.getmembers():
                p = Path(m.name)
                if m.isfile() and p.suffix == ".so" and p.parent.name == p.stem:
                    put(p.stem, tar.extractfile(m).read())
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = steps(args)
    if args.dry_run:
        for s in plan:
            where = f" [{'background, ' if s.background else ''}cores: {s.cpus}]" if s.cpus else ""
            print(f"{s.name} (<= {s.cap:.0f} s){where}: {shlex.join(s.argv({}))[:300]}  > bench/results/gpu/{s.log}")
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    r = Runner(args)
    failed: list[str] = []
    baseline = next((s for s in plan if s.name == "baseline"), None)
    for s in plan:
        if s.name == "baseline":
            continue
        if s.name == "flashinfer-jit":             # the JIT build and the baseline, side by side
            failed += _jit_and_baseline(r, s, baseline, args)
            continue
        rc = r.run_step(s)
        if rc not in (0, None):
            failed.append(s.name)
            if s.name == "install":
                break
        if s.name == "install" and rc == 0:
            gone = missing_modules()
            if gone:
                print(f"gpu_check: still missing after install: {' '.join(gone)}", flush=True)
        if s.name == "install" and args.jit_cache and args.jit_cache.is_file():
            names = install_jit_cache(args.jit_cache)
            r.record["prebuilt_kernels"] = names
            print(f"gpu_check: {len(names)} prebuilt FlashInfer modules from {args.jit_cache}", flush=True)
        if s.name == "environment" and rc == 0:
            text = (RESULTS / s.log).read_text()          # the JSON object, after any warnings
            try:
                r.ctx["env"] = json.loads(text[text.index("{"):text.rindex("}") + 1])
            except ValueError:
                pass
    if baseline is not None and not any(s.name == "flashinfer-jit" for s in plan):
        rc = r.run_step(baseline)
        if rc not in (0, None):
            failed.append("baseline")
    skipped = [st["name"] for st in r.record["steps"] if st["rc"] is None]
    r.record["failed"], r.record["skipped"] = failed, skipped
    r.save()
    print("\n=== gpu_check: " + ("all steps passed" if not failed and not skipped else
                                  f"failed: {', '.join(failed) or '-'}; skipped: {', '.join(skipped) or '-'}"),
          flush=True)
    return 1 if failed else 0


def _jit_and_baseline(r: Runner, jit: Step, baseline: Step | None, args: argparse.Namespace) -> list[str]:
    """The JIT build in the background (all cores but two) while the baseline runs on those two."""
    failed = []
    running = r.start(jit)
    if baseline is not None:
        rc = r.run_step(baseline)
        if rc not in (0, None):
            failed.append("baseline")
    if running is not None:
        if r.finish(running) != 0:
            failed.append("flashinfer-jit")
            return failed
        built = install_jit_cache(JIT_BASE) if JIT_BASE.is_dir() else []
        if built:
            print(f"gpu_check: {len(built)} compiled modules installed as prebuilt: {', '.join(built)}", flush=True)
        if args.copy_to:
            size = pack_jit(args.copy_to / "flashinfer_jit.tar.gz")
            if size:
                print(f"gpu_check: compiled kernels packed ({size / 2**20:.1f} MiB)", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
