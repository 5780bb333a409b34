"""How to select ``remote_backend=arctic`` on the verl in use.

verl 0.9.1's ``ppo_trainer.yaml`` has no ``remote_backend`` group in its defaults list, so Hydra
needs the group *added*: ``+remote_backend=arctic`` on the command line, ``- remote_backend:
arctic`` in a config file's defaults. A verl with PR #7102 lists ``optional
remote_backend@remote_backend: null`` there, and adding it again fails with ``Multiple values for
remote_backend``: the group is *chosen* instead, ``remote_backend=arctic`` /
``- override remote_backend: arctic``. :func:`group_forms` reads the installed verl's defaults list
and answers both forms; ``python -m arctic_platform.integrations.verl.hydra_group`` prints the
command-line one (the example launchers use it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

GROUP = "remote_backend"
CHOICE = "arctic"


@dataclass(frozen=True)
class GroupForms:
    """The two spellings of selecting the arctic remote backend on one verl."""

    command_line: str  # ``remote_backend=arctic`` or ``+remote_backend=arctic``
    defaults_entry: str  # ``override remote_backend: arctic`` or ``remote_backend: arctic``


def verl_config_dir() -> Path:
    """The installed verl's trainer config folder."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ImportError("verl is not installed (pip install 'arctic-platform[verl]')")
    return Path(spec.origin).parent / "trainer" / "config"


def declares_group(config_dir: Path, config_name: str = "ppo_trainer") -> bool:
    """Whether ``config_name``'s defaults list has a ``remote_backend`` entry."""
    import yaml

    data = yaml.safe_load((config_dir / f"{config_name}.yaml").read_text()) or {}
    for entry in data.get("defaults") or []:
        keys = entry.keys() if isinstance(entry, dict) else [entry]
        for key in keys:
            name = str(key).removeprefix("optional ").removeprefix("override ").split("@")[0]
            if name.strip().lstrip("/") == GROUP:
                return True
    return False


def group_forms(config_dir: Path | None = None) -> GroupForms:
    """The forms for the verl whose trainer configs live in ``config_dir`` (default: installed)."""
    if declares_group(config_dir or verl_config_dir()):
        return GroupForms(f"{GROUP}={CHOICE}", f"override {GROUP}: {CHOICE}")
    return GroupForms(f"+{GROUP}={CHOICE}", f"{GROUP}: {CHOICE}")


if __name__ == "__main__":
    print(group_forms().command_line)
