"""Make the folder that travels to a GPU machine without a package index, and prove it here.

    python -m bench.gpu_bundle [--out .gpu_bundle] [--verify]     (make gpu-bundle)

A GPU machine lent for checks has Python 3.12 with CUDA torch, numpy, tokenizers, safetensors,
jinja2, msgpack, httpx, prometheus-client, pytest, transformers, matplotlib and ninja, but no
package index, and at most 64 MiB travels with the repository. The bundle holds what is missing
there, and nothing it has:

- wheels/: CPython 3.12 manylinux x86-64 wheels of this project's other runtime and test
  dependencies (fastapi, uvicorn, pydantic, redis, pyzmq, gguf, llguidance, openai, jsonschema and
  what they need), pinned to the versions installed here, so the GPU run uses what the CPU suite
  tested; plus flashinfer-python built here into a wheel from its PyPI sdist (pure Python: its
  CUDA kernels compile on the GPU at first use), so nothing is built there but those kernels;
- model/: config.json, tokenizer.json and tokenizer_config.json of the default model
  (SmolLM2-135M-Instruct), written from its GGUF: the 96 MB GGUF does not travel, and the GPU
  check gives these files random weights at their real shapes (bench.gpu_serve_check);
- bundle.json: every file with its size and sha256, the pins, and the date.

On the GPU machine, bench.gpu_check installs it with
`pip install --no-index --no-deps --target DIR wheels/*.whl` and PYTHONPATH=DIR.

--verify proves it on this machine: a fresh Python 3.12 venv (pyenv's), the bundle installed
exactly as the GPU machine installs it, the packages that machine already has from PyPI (torch
excepted: no CPU build of torch for Python 3.12 is reachable here), then every product module is
imported (modules that need torch are listed as such and imported on the GPU machine's first step)
and `python -m bench.gpu_check --dry-run` runs.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".gpu_bundle"
LIMIT_BYTES = 60 * 2**20          # the repository and the bundle travel together, 64 MiB in all
FLASHINFER = "flashinfer-python==0.3.1"   # the sdist the GPU notes found to JIT-compile on CUDA 13
# What the GPU check imports that the GPU machine lacks; the closure is resolved by pip.
NEEDED = ["fastapi", "uvicorn", "pydantic", "redis", "pyzmq", "gguf", "llguidance", "openai",
          "jsonschema"]
# Already on the GPU machine (its image's package list): not carried, so its builds stay in use.
PRESENT = {"numpy", "pyyaml", "requests", "urllib3", "charset-normalizer", "certifi", "idna", "tqdm",
           "click", "attrs", "msgpack", "httpx", "httpcore", "jinja2", "markupsafe", "prometheus-client",
           "packaging", "tokenizers", "safetensors", "torch", "filelock", "fsspec", "sympy", "networkx"}
# Packages the GPU machine has, installed into the --verify venv from PyPI (torch excepted).
MACHINE_HAS = ["numpy", "tokenizers", "safetensors", "jinja2", "msgpack", "httpx", "prometheus-client",
               "tqdm", "pyyaml", "pytest", "pytest-timeout", "hypothesis", "requests", "matplotlib"]
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins() -> list[str]:
    """NEEDED at the versions installed in this environment (what the CPU suite ran)."""
    out = []
    for name in NEEDED:
        try:
            out.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            raise SystemExit(f"gpu_bundle: {name} is not installed here; run `make install` first") from None
    return out


def download_wheels(dest: Path, requirements: list[str]) -> list[Path]:
    """pip download of the closure for CPython 3.12 manylinux x86-64; drops what the GPU machine has."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)
    kept = []
    for whl in sorted(dest.glob("*.whl")):
        if canonical(whl.name.split("-")[0]) in PRESENT:
            whl.unlink()
        else:
            kept.append(whl)
    return kept


def sdist_url(requirement: str) -> tuple[str, str, str]:
    """(filename, url, sha256) of a release's sdist from PyPI's JSON simple API (PEP 691)."""
    name, version = requirement.split("==")
    req = urllib.request.Request(f"https://pypi.org/simple/{canonical(name)}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    fname = f"{name.replace('-', '_')}-{version}.tar.gz"
    for f in files:
        if f["filename"] == fname:
            return fname, f["url"], f["hashes"]["sha256"]
    raise SystemExit(f"gpu_bundle: no sdist {fname} on PyPI")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def flashinfer_wheel(dest: Path, cache: Path) -> Path:
    """Download the sdist (sha256 checked), build its pure-Python wheel into dest."""
    fname, url, digest = sdist_url(FLASHINFER)
    sdist = cache / fname
    if not sdist.is_file() or sha256(sdist) != digest:
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {fname}", file=sys.stderr)
        urllib.request.urlretrieve(url, sdist)
        if sha256(sdist) != digest:
            raise SystemExit(f"gpu_bundle: {fname} does not match PyPI's sha256")
    version = FLASHINFER.split("==")[1]
    have = list(dest.glob(f"flashinfer_python-{version}-*.whl"))
    if have:
        return have[0]
    print(f"building the flashinfer wheel from {fname} (pure Python, ~2 min)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(sdist)],
                   check=True)
    return next(dest.glob(f"flashinfer_python-{version}-*.whl"))


def write_model_files(dest: Path) -> list[Path]:
    """config.json, tokenizer.json, tokenizer_config.json of the default GGUF (no weights)."""
    sys.path.insert(0, str(ROOT))
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    from worker_svc.loader import read_config

    source = resolve_model(None)
    cfg = read_config(source)
    tok = load_tokenizer(source)
    dest.mkdir(parents=True, exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
          "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
          "tie_word_embeddings": cfg.tie_word_embeddings, "eos_token_id": cfg.eos_token_ids,
          "torch_dtype": "bfloat16"}
    if cfg.rope_scaling:
        hf["rope_scaling"] = cfg.rope_scaling
    (dest / "config.json").write_text(json.dumps(hf, indent=1))
    tok.backend.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}, indent=1))
    return [dest / n for n in ("config.json", "tokenizer.json", "tokenizer_config.json")]


def make(out: Path, cache: Path) -> dict:
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    requirements = pins()
    kept = download_wheels(wheels, requirements)
    fi = flashinfer_wheel(cache, cache)
    shutil.copy2(fi, wheels / fi.name)
    model = write_model_files(out / "model")
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "bundle.json")
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench.gpu_bundle " + " ".join(sys.argv[1:]),
        "pins": requirements, "flashinfer": FLASHINFER, "total_bytes": total,
        "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
        "install": "pip install --no-index --no-deps --target DIR wheels/*.whl; PYTHONPATH=DIR",
    }
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1))
    print(f"bundle {out}: {len(kept) + 1} wheels + {len(model)} model files, {total / 2**20:.1f} MiB "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu_bundle: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB limit")
    return manifest


IMPORT_ALL = r"""
import importlib, pkgutil, sys, json
mods, needs_torch, failed = [], [], {}
for pkg in ("shared", "gateway", "scheduler_svc", "kvstore", "worker_svc", "sarathi"):
    p = importlib.import_module(pkg)
    mods.append(pkg)
    mods += [m.name for m in pkgutil.walk_packages(p.__path__, pkg + ".") if not m.name.endswith("__main__")]
for m in mods:
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as e:
        (needs_torch.append(m) if e.name == "torch" else failed.__setitem__(m, repr(e)))
    except Exception as e:
        failed[m] = repr(e)
print(json.dumps({"modules": len(mods), "imported": len(mods) - len(needs_torch) - len(failed),
                  "needs_torch": needs_torch, "failed": failed}))
sys.exit(1 if failed else 0)
"""


def find_python312() -> str:
    for cand in (shutil.which("python3.12"), *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))):
        if cand and subprocess.run([str(cand), "--version"], capture_output=True).returncode == 0:
            return str(cand)
    raise SystemExit("gpu_bundle --verify: no Python 3.12 found (pyenv install 3.12)")


def verify(out: Path) -> dict:
    """The GPU machine's install, done here in a fresh 3.12 venv (see module docstring)."""
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-verify-") as tmp:
        venv, site = Path(tmp) / "venv", Path(tmp) / "site"
        subprocess.run([find_python312(), "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        subprocess.run([py, "-m", "pip", "install", "-q", *MACHINE_HAS], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, sorted((out / "wheels").glob("*.whl")))], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
        r = subprocess.run([py, "-c", IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True)
        report = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"error": r.stderr}
        dry = subprocess.run([py, "-m", "bench.gpu_check", "--dry-run", "--bundle", str(out)], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        report["dry_run_ok"] = dry.returncode == 0
        print(dry.stdout + dry.stderr)
        print(json.dumps(report, indent=1))
        if r.returncode != 0 or dry.returncode != 0:
            raise SystemExit("gpu_bundle --verify: failed (see above)")
        return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sarathi" / "gpu-bundle",
                    help="where the flashinfer sdist and its wheel are kept between runs")
    ap.add_argument("--verify", action="store_true", help="prove the bundle in a fresh Python 3.12 venv")
    ap.add_argument("--verify-only", action="store_true", help="verify an existing bundle, make nothing")
    args = ap.parse_args(argv)
    if not args.verify_only:
        make(args.out, args.cache)
    if args.verify or args.verify_only:
        verify(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
