"""Where `meshlm xds-server` keeps what must outlive it: the mesh CA's root and join tokens
(`identity/`), rollouts (`rollouts.json`), quarantined request classes (`isolation.json`) and,
alone (no --store), the hosts registered with it (`registrations/hosts.json`).

`--state-dir`, else $MESHLM_STATE_DIR, else `$XDG_STATE_HOME/meshlm/<mesh file name>-<hash of its
path>` ($XDG_STATE_HOME defaults to `~/.local/state`): one dir per mesh file, outside the folder
the mesh file is in, which is often a repository. Earlier versions kept it in `.meshlm/` beside
the mesh file; one that holds state, while the new default does not exist yet, is used where it
is (the caller says so), so an upgrade never loses a CA or a rollout.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

STATE_ENV = "MESHLM_STATE_DIR"
LEGACY = ".meshlm"
# What a control plane writes there (with --store, per replica: identity-<id>, isolation-<id>).
_STATE_NAMES = ("identity*", "rollouts.json", "isolation*.json")


def default_state_dir(mesh_file: str | Path) -> Path:
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    mesh = Path(mesh_file).resolve()
    digest = hashlib.sha256(str(mesh).encode()).hexdigest()[:12]
    return base / "meshlm" / f"{mesh.stem}-{digest}"


def legacy_state_dir(mesh_file: str | Path) -> Path:
    return Path(mesh_file).resolve().parent / LEGACY


def holds_state(path: Path) -> bool:
    return any(next(path.glob(name), None) for name in _STATE_NAMES)


def choose_state_dir(mesh_file: str | Path, given: str | None) -> tuple[Path, str]:
    """(the state dir, how it was chosen: a phrase for the start line)."""
    if given:
        return Path(given), "--state-dir"
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]), f"${STATE_ENV}"
    new, old = default_state_dir(mesh_file), legacy_state_dir(mesh_file)
    if not new.exists() and holds_state(old):
        return old, (
            f"found beside the mesh file, as earlier versions kept it; the default is now "
            f"{new}: move it there to keep it out of the mesh file's folder"
        )
    return new, "the default for this mesh file"
