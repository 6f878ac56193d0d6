"""torchvision for the zoo, installed beside (never into) the virtual environment.

torchvision's PyPI wheel is built against a CUDA torch: its compiled ops (``torchvision._C``) do not load beside
torch 2.13.0+cpu, and its ``__init__`` then fails registering fake kernels for ``torchvision::nms`` and friends. The
zoo's torchvision models (resnet18, mobilenet_v3_small, efficientnet_b0, convnext_tiny, ``weights=None``) are pure
Python, so the wheel is installed with ``--no-deps`` into ``.zoo-deps/`` (torch stays as it is) and imported with
those fake-kernel registrations skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPS_DIR = REPO / ".zoo-deps"
# The torchvision release built for torch 2.13 (its wheel requires torch==2.13.0).
TORCHVISION = "torchvision==0.28.0"


def torchvision_installed(target: Path = DEPS_DIR) -> bool:
    """Whether ``target`` holds the pinned torchvision."""
    version = TORCHVISION.split("==")[1]
    return (target / "torchvision" / "__init__.py").is_file() and (target / f"torchvision-{version}.dist-info").is_dir()


def ensure_torchvision(target: Path = DEPS_DIR) -> Path:
    """Install the pinned torchvision into ``target`` (without dependencies) unless it is there; return ``target``.

    pip writes into a temporary directory that is renamed into place, so an interrupted install leaves nothing
    half-written for the next run to trust.
    """
    if torchvision_installed(target):
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), TORCHVISION]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"installing {TORCHVISION} into {target} failed: {done.stderr.strip()[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def import_torchvision() -> types.ModuleType:
    """Import torchvision from ``.zoo-deps`` (installing it first if needed) without its compiled ops."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    target = str(ensure_torchvision())
    # Its fake-kernel registrations need the compiled ops; the models used here never call them.
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    # On sys.path only for this import: child processes inherit sys.path (PYTHONPATH built from it, spawn), and a
    # torchvision found there without the stub above breaks ``import transformers`` models in them. Submodules
    # imported later are found through the package's own ``__path__``.
    added = target not in sys.path
    if added:
        sys.path.insert(0, target)
    try:
        import torchvision
    finally:
        if added:
            sys.path.remove(target)
    return torchvision
