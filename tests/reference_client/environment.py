"""A separate Python environment holding the published reference client (PyPI
``arctic-platform==0.1.4``), so its code runs unmodified next to ours.

The wheel and the one dependency our environment lacks (``pydantic-settings``, with
``python-dotenv``) are downloaded once into a cache folder and unpacked into a fresh venv. The
venv sees our environment's third-party packages (torch, numpy, aiohttp, ...) through a path
entry, but not our ``arctic_platform``: that path is not a site directory, so our editable
install's ``.pth`` finder is never run there, and scripts run isolated (``-I``) from a scratch
folder. The wheel declares Python >= 3.12; it is unpacked regardless (its code runs on 3.11),
which is why it is unpacked rather than installed by pip. Its ``.dist-info`` is left out: the
reference gates its on-prem transports on the GPU training stack (DeepSpeed, liger) being
installed, read from that metadata, and skips the gate when the package runs without metadata
(the reference's "uninstalled checkout" mode). The transports themselves need none of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

WHEELS = ("arctic-platform==0.1.4", "pydantic-settings>=2,<3", "python-dotenv>=1")


class Unavailable(Exception):
    """The reference client could not be fetched (no package index reachable)."""


def reference_python(cache: Path) -> Path:
    """The interpreter of the reference client's venv under ``cache`` (built on first use)."""
    root = cache / "venv"
    python = root / "bin" / "python"
    done = root / ".complete"
    if done.exists():
        return python
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for requirement in WHEELS:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            + (["--python-version", "3.12"] if requirement.startswith("arctic") else [])
            + ["-d", str(wheels), requirement],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if download.returncode != 0:
            raise Unavailable(f"pip download {requirement} failed: {download.stderr[-500:]}")
    venv.EnvBuilder(with_pip=False, clear=True).create(root)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            if wheel.name.startswith("arctic_platform"):
                names = [n for n in names if ".dist-info/" not in n]
            archive.extractall(site, members=names)
    (site / "_host_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done.touch()
    return python


def run_reference(python: Path, script: str, *, cwd: Path, timeout: float = 900) -> str:
    """Run ``script`` under the reference client (isolated); its stdout, or an error with stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    result = subprocess.run(
        [str(python), "-I", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(f"reference client script failed:\n{result.stderr[-4000:]}")
    return result.stdout
