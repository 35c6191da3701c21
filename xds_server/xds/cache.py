"""Desired state -> one snapshot per sidecar group; the seam the ADS streams read from.

A change is *staged* (built and checked at once, so a bad change fails in the caller) and
*published* later by the debouncer, which wakes every stream. Sidecars with equal NodeInfo share
one snapshot, built once.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

from xds_server import mesh as m
from xds_server.resources.build import build_resources
from xds_server.xds.node import NodeInfo
from xds_server.xds.snapshot import Snapshot, build_snapshot, version_generation


class SnapshotCache:
    def __init__(self, mesh: m.Mesh, incarnation: str) -> None:
        self.incarnation = incarnation
        self._lock = threading.Lock()
        self._generation = 0  # newest staged
        self._published_generation = 0
        self._mesh = mesh  # published
        self._staged_mesh = mesh
        self._snapshots: dict[NodeInfo, Snapshot] = {}
        self._staged: dict[NodeInfo, Snapshot] = {}
        self._errors: dict[NodeInfo, str] = {}
        # group -> type -> generations at which that type's content changed (ascending)
        self._changes: dict[NodeInfo, dict[str, list[int]]] = {}
        # expected_generations' answers until the next change of the above: every ACK of
        # thousands of sidecars of one group asks the same question.
        self._expected: dict[tuple[NodeInfo, int], dict[str, int]] = {}
        self._watchers: set[Callable[[], None]] = set()
        self._generations: dict[str, int] = {}  # version string -> generation, as parsed

    # -- reads (any thread) ------------------------------------------------------------------
    @property
    def mesh(self) -> m.Mesh:
        """The newest accepted desired state (staged or published)."""
        return self._staged_mesh

    @property
    def generation(self) -> int:
        return self._generation

    def snapshot(self, group: NodeInfo) -> Snapshot | None:
        """The published snapshot of a group, built on first use; None if it cannot be built
        (see `error`)."""
        with self._lock:
            snap = self._snapshots.get(group)
            if snap is None and group not in self._errors:
                try:
                    snap = self._build(group, self._mesh, self._published_generation, None)
                except ValueError as e:
                    self._errors[group] = str(e)
                    return None
                self._snapshots[group] = snap
                self._changes[group] = {tu: [snap.generation] for tu in snap.types}
                self._expected.clear()
            return snap

    def error(self, group: NodeInfo) -> str | None:
        return self._errors.get(group)

    def groups(self) -> dict[NodeInfo, Snapshot]:
        with self._lock:
            return dict(self._snapshots)

    def expected_generations(self, group: NodeInfo, generation: int) -> dict[str, int]:
        """For each type the group has: the generation whose version a sidecar must have ACKed
        (or later) to hold the state of `generation`."""
        with self._lock:
            known = self._expected.get((group, generation))
            if known is not None:
                return known
            out = {}
            snap = self._snapshots.get(group)
            for tu, gens in self._changes.get(group, {}).items():
                if snap is not None and not snap.get(tu).items:
                    continue  # nothing of this type any more; nothing to ACK
                i = bisect.bisect_right(gens, generation)
                if i:
                    out[tu] = gens[i - 1]
            if len(self._expected) >= 4096:
                self._expected.clear()
            self._expected[(group, generation)] = out
            return out

    def changed_groups(self, generation: int) -> list[NodeInfo]:
        with self._lock:
            return [
                g
                for g, per_type in self._changes.items()
                if any(
                    gens and gens[-1] >= generation and _contains(gens, generation)
                    for gens in per_type.values()
                )
            ]

    def generation_of(self, version: str) -> int:
        gen = self._generations.get(version)
        if gen is None:
            if len(self._generations) >= 4096:
                self._generations.clear()
            gen = self._generations[version] = version_generation(version, self.incarnation)
        return gen

    # -- writes --------------------------------------------------------------------------------
    def stage(self, mesh: m.Mesh, live: set[NodeInfo] | None = None) -> int:
        """Build and check every group's snapshot for `mesh`; raise ValueError (naming the group
        and the field) and change nothing if any group in `live` (default: all) cannot take it.
        A group outside `live` (no sidecar connected) that cannot take it is dropped instead,
        so a departed sidecar never vetoes a change. Returns the new generation."""
        with self._lock:
            gen = self._generation + 1
            staged: dict[NodeInfo, Snapshot] = {}
            dropped = []
            for group in self._snapshots:
                prev = self._staged.get(group) or self._snapshots[group]
                try:
                    staged[group] = self._build(group, mesh, gen, prev)
                except ValueError as e:
                    if live is not None and group not in live:
                        dropped.append(group)
                        continue
                    raise ValueError(f"sidecars with {group.label()}: {e}") from None
            self._drop(dropped)
            for group, snap in staged.items():
                prev = self._staged.get(group) or self._snapshots[group]
                for tu in set(snap.types) | set(prev.types):
                    if snap.version(tu) != prev.version(tu):
                        self._changes[group].setdefault(tu, []).append(gen)
            self._generation = gen
            self._staged_mesh = mesh
            self._staged = staged
            self._expected.clear()
            return gen

    def check(self, mesh: m.Mesh, live: set[NodeInfo]) -> None:
        """Raise ValueError as `stage` would for a group in `live` that cannot take `mesh`;
        stages nothing (replicas check a change before writing it to the store)."""
        with self._lock:
            groups = [g for g in self._snapshots if g in live]
        for group in groups:
            try:
                build_resources(mesh, group)
            except ValueError as e:
                raise ValueError(f"sidecars with {group.label()}: {e}") from None

    def publish(self) -> None:
        """Make the staged state visible and wake every stream (called by the debouncer)."""
        with self._lock:
            if self._staged_mesh is self._mesh and not self._staged:
                return
            self._mesh = self._staged_mesh
            gen = self._generation
            for group, snap in list(self._snapshots.items()):
                if group in self._staged:
                    continue  # connected after the change was staged: build it now
                try:
                    new = self._build(group, self._mesh, gen, snap)
                except ValueError as e:
                    self._errors[group] = str(e)
                    continue
                self._staged[group] = new
                for tu in set(new.types) | set(snap.types):
                    if new.version(tu) != snap.version(tu):
                        self._changes[group].setdefault(tu, []).append(gen)
            self._snapshots.update(self._staged)
            self._staged = {}
            self._expected.clear()
            self._published_generation = gen
            for group in [g for g in self._errors if g not in self._snapshots]:
                del self._errors[group]  # groups that failed may build under the new mesh
            watchers = list(self._watchers)
        for w in watchers:
            w()

    def retain(self, groups: set[NodeInfo]) -> None:
        """Forget the snapshots of every group not in `groups` (no sidecar uses them)."""
        with self._lock:
            self._drop([g for g in self._snapshots if g not in groups])
            for g in [g for g in self._errors if g not in groups]:
                del self._errors[g]

    def _drop(self, groups: list[NodeInfo]) -> None:
        self._expected.clear()
        for g in groups:
            self._snapshots.pop(g, None)
            self._staged.pop(g, None)
            self._changes.pop(g, None)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` on every publish; returns the function that stops it."""
        with self._lock:
            self._watchers.add(callback)
        return lambda: self._watchers.discard(callback)

    def _build(self, group: NodeInfo, mesh: m.Mesh, gen: int, prev: Snapshot | None) -> Snapshot:
        return build_snapshot(
            build_resources(mesh, group),
            incarnation=self.incarnation,
            generation=gen,
            previous=prev,
        )


def _contains(sorted_list: list[int], x: int) -> bool:
    i = bisect.bisect_left(sorted_list, x)
    return i < len(sorted_list) and sorted_list[i] == x
