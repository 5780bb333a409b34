"""Where a job's actors run: devices, placement groups, and colocation shares.

A "device" is one GPU on a GPU cluster and one CPU otherwise. Each training rank, sampling replica
and log-prob replica is one actor on one device.

Every job reserves its actors' resources as one Ray placement group before any actor starts, so a
job starts whole or waits whole (two half-started jobs never hold each other's devices), and what
it waits for is one thing Ray can report on:

* **Separate devices** (default): one bundle per actor. On GPUs every actor asks for a whole GPU,
  so a job with N training workers, a sampler and a log-prob scorer needs N + 2 GPUs. On CPUs each
  actor asks for its role's share of a CPU (below): Ray's CPU counts are bookkeeping only (the OS
  shares the cores), and whole CPUs would make a laptop-sized cluster refuse small jobs.
* **Colocated** (``colocate``): ``max(training workers, samplers, scorers)`` device bundles,
  packed onto as few nodes as possible; training rank ``r`` runs in bundle ``r``, sampler ``i``
  in bundle ``i``, scorer ``j`` in bundle ``j`` (modulo the bundle count), with shares 0.34 /
  0.33 / 0.33 of the device, as the reference server does. A GPU bundle reserves its whole GPU
  (and one CPU); a CPU bundle reserves the sum of the shares placed in it. The shares are Ray
  accounting, not memory limits: on a GPU the roles take turns through sleep/wake.

Waiting (:meth:`Placement.create`): a demand the cluster can never hold fails at once, naming
``training_config.n_gpus`` and the cluster's totals: more of a resource than the cluster has in
total, or a bundle Ray reports ``INFEASIBLE`` (no node could ever hold it). With ``autoscaling``
(the cluster can add nodes) such a demand waits instead. A demand that fits but is held by other
jobs waits up to the operator's ``placement_timeout_s`` (``serve --placement-timeout``), saying
once in the job's log what it waits for; a cancel of the job removes the pending group at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.engine import cancellation

SHARES = {"training": 0.34, "sampling": 0.33, "log_prob": 0.33}
ROLES = ("training", "sampling", "log_prob")
# How long a job waits for resources other jobs hold, unless the operator says otherwise.
PLACEMENT_TIMEOUT_S = 600.0
# How often a pending placement looks at Ray's report on it and at the job's cancel token.
POLL_S = 0.2


@dataclass(frozen=True)
class JobShape:
    """How many actors of each role a job has."""

    training_workers: int = 0
    samplers: int = 0
    scorers: int = 0

    @property
    def devices(self) -> int:
        """Devices the colocated layout needs: the largest role."""
        return max(self.training_workers, self.samplers, self.scorers, 1)

    def shares_per_device(self) -> list[float]:
        """The colocated layout's load on each device, in device fractions."""
        loads = [0.0] * self.devices
        for role, count in (
            ("training", self.training_workers),
            ("sampling", self.samplers),
            ("log_prob", self.scorers),
        ):
            for index in range(count):
                loads[index % self.devices] += SHARES[role]
        return [round(load, 6) for load in loads]

    def total_share(self) -> float:
        return sum(self.shares_per_device())


@dataclass(frozen=True)
class PlacementWait:
    """How a job waits for its placement: the operator's limit, whether the cluster can grow,
    and where to say what it waits for (the job's log)."""

    timeout_s: float
    note: Callable[[str], None]
    # Who else holds resources (other jobs of this server), for the note; "" when unknown.
    holders: Callable[[], str]
    autoscaling: bool = False


@dataclass
class Placement:
    """A job's placement: device kind, its bundles and the placement group holding them."""

    use_gpu: bool
    shape: JobShape
    colocate: bool
    group: Any = None
    # The node each bundle was placed on (hex node ids, by bundle index), read once the group is
    # ready: after a node is lost Ray reschedules its bundles, so this is where the actors ran.
    bundle_nodes: dict[int, str] = field(default_factory=dict)
    _released: bool = field(default=False, repr=False)

    @classmethod
    def create(
        cls, *, name: str, device: str, shape: JobShape, colocate: bool, wait: PlacementWait
    ) -> Placement:
        """Reserve the job's bundles as the placement group ``name`` (``ray list
        placement-groups`` shows it), waiting as the module doc says.

        Raises ValueError naming the setting when the cluster can never hold the job,
        TimeoutError when the bundles stay busy for ``wait.timeout_s``, and
        :class:`~arctic_platform.engine.cancellation.OpCancelled` when the job is cancelled
        meanwhile; the pending group is removed in each case.
        """
        import ray

        totals = ray.cluster_resources()
        placement = cls(use_gpu=_uses_gpu(device, totals), shape=shape, colocate=colocate)
        if not wait.autoscaling:
            placement._check_fits(totals)
        placement.reserve(wait, name=name)
        return placement

    def reserve(self, wait: PlacementWait, *, name: str = "") -> None:
        """Create the placement group and wait for it (see :meth:`create`); nothing is left
        reserved or pending when this raises."""
        from ray.util.placement_group import placement_group, placement_group_table

        self.group = placement_group(self.bundles(), strategy="PACK", name=name)
        try:
            self._wait_ready(wait)
            self.bundle_nodes = dict(placement_group_table(self.group)["bundles_to_node_id"])
        except BaseException:
            self.release()
            raise

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per device (colocated) or per actor, in the order :meth:`options` uses."""
        shape = self.shape
        if self.colocate:
            if self.use_gpu:
                return [{"GPU": 1.0, "CPU": 1.0} for _ in range(shape.devices)]
            return [{"CPU": load} for load in shape.shares_per_device()]
        counts = (shape.training_workers, shape.samplers, shape.scorers)
        if self.use_gpu:
            return [{"GPU": 1.0, "CPU": 1.0} for _ in range(sum(counts))]
        return [
            {"CPU": SHARES[role]} for role, n in zip(ROLES, counts, strict=True) for _ in range(n)
        ]

    def describe(self) -> str:
        """What the job reserves, for log lines: ``3 bundles (1.01 CPU)``."""
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for kind, amount in bundle.items():
                total[kind] = total.get(kind, 0.0) + amount
        amounts = ", ".join(f"{amount:g} {kind}" for kind, amount in sorted(total.items()))
        return f"{len(self.bundles())} bundle(s) ({amounts})"

    @property
    def device(self) -> str:
        """The torch device string inside each actor (Ray exposes its GPU as device 0)."""
        return "cuda" if self.use_gpu else "cpu"

    def options(self, role: str, index: int) -> dict:
        """``actor.options(...)`` for the ``index``-th actor of ``role``: its share of its
        bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.colocate:
            share = SHARES[role]
            resources = {"num_cpus": share, "num_gpus": share if self.use_gpu else 0}
        elif self.use_gpu:
            resources = {"num_cpus": 1, "num_gpus": 1}
        else:
            resources = {"num_cpus": SHARES[role], "num_gpus": 0}
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self._bundle(role, index)
        )
        return {**resources, "scheduling_strategy": strategy}

    def node_of(self, role: str, index: int) -> str | None:
        """The node (hex id) the ``index``-th actor of ``role`` was placed on; None before the
        group is ready."""
        return self.bundle_nodes.get(self._bundle(role, index))

    def _bundle(self, role: str, index: int) -> int:
        """The bundle the ``index``-th actor of ``role`` runs in (see module doc)."""
        if self.colocate:
            return index % self.shape.devices
        counts = (self.shape.training_workers, self.shape.samplers, self.shape.scorers)
        return sum(counts[: ROLES.index(role)]) + index

    def release(self) -> None:
        """Give the placement group back to the cluster (pending or not); idempotent."""
        if self._released:
            return
        self._released = True
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)

    def _wait_ready(self, wait: PlacementWait) -> None:
        import ray
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + wait.timeout_s
        reported = None
        while not self.group.wait(timeout_seconds=POLL_S):
            cancellation.check()
            state = placement_group_table(self.group).get("stats", {}).get("scheduling_state")
            infeasible = state == "INFEASIBLE"
            if infeasible and not wait.autoscaling:
                raise ValueError(self._too_large(ray.cluster_resources(), infeasible=True))
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"placement: the job's {self.describe()} were not free within "
                    f"{wait.timeout_s:g}s (serve --placement-timeout); available now: "
                    f"{_amounts(ray.available_resources())}"
                )
            if reported != infeasible:  # once, and again if Ray finds it infeasible later
                reported = infeasible
                holders = wait.holders()
                wait.note(
                    f"waiting for Ray resources: {self.describe()}"
                    + (
                        " (no node can hold it yet: waiting for the autoscaler)"
                        if infeasible
                        else ""
                    )
                    + f"; available now: {_amounts(ray.available_resources())}"
                    + (f"; held by {holders}" if holders else "")
                    + f"; gives up after {wait.timeout_s:g}s"
                )

    def _check_fits(self, totals: dict) -> None:
        """Refuse a demand larger than the cluster's total of a resource (Ray reports such a
        group only as waiting for resources, since each bundle alone would fit)."""
        for kind in ("GPU", "CPU"):
            need = sum(bundle.get(kind, 0.0) for bundle in self.bundles())
            if need > float(totals.get(kind, 0.0)) + 1e-9:
                raise ValueError(self._too_large(totals, kind=kind))

    def _too_large(self, totals: dict, *, kind: str | None = None, infeasible: bool = False) -> str:
        kind = kind or ("GPU" if self.use_gpu else "CPU")
        need = sum(bundle.get(kind, 0.0) for bundle in self.bundles())
        shape = self.shape
        what = (
            f"{shape.training_workers} training worker(s), {shape.samplers} sampler(s), "
            f"{shape.scorers} log-prob scorer(s){', colocated' if self.colocate else ''}"
        )
        largest = max(self.bundles(), key=lambda bundle: bundle.get(kind, 0.0))
        why = (
            f"Ray reports the placement infeasible: no node can hold a bundle of {largest}"
            if infeasible
            else "it can never be placed"
        )
        return (
            f"training_config.n_gpus: the job needs {need:g} {kind} ({what}) but the Ray cluster "
            f"has {float(totals.get(kind, 0.0)):g} {kind} in total; {why}"
        )


def _amounts(resources: dict) -> str:
    """The CPU/GPU amounts of a Ray resource dict (not its per-node and per-group entries)."""
    return (
        ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in ("GPU", "CPU") if k in resources)
        or "none"
    )


def _uses_gpu(device: str, totals: dict) -> bool:
    gpus = float(totals.get("GPU", 0.0))
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        if gpus <= 0:
            raise ValueError(f"device: {device!r} was asked for but the Ray cluster has no GPU")
        return True
    if device != "auto":
        raise ValueError(f"device: {device!r} is not supported on Ray; use auto, cpu or cuda")
    return gpus > 0
