"""Where a job's actors run: devices, placement groups, and colocation shares.

A "device" is one GPU on a GPU cluster and one CPU otherwise. Each training rank, sampling replica
and log-prob replica is one actor on one device.

* **Separate devices** (default): on GPUs every actor asks for a whole GPU, so a job with N
  training workers, a sampler and a log-prob scorer needs N + 2 GPUs. On CPUs each actor asks for
  its role's share of a CPU (below): Ray's CPU counts are bookkeeping only (the OS shares the
  cores), and whole CPUs would make a laptop-sized cluster refuse small jobs.
* **Colocated** (``colocate``): the job gets one placement group of ``max(training workers,
  samplers, scorers)`` device bundles, packed onto as few nodes as possible; training rank ``r``
  runs in bundle ``r``, sampler ``i`` in bundle ``i``, scorer ``j`` in bundle ``j`` (modulo the
  bundle count), with shares 0.34 / 0.33 / 0.33 of the device, as the reference server does. A
  GPU bundle reserves its whole GPU (and one CPU); a CPU bundle reserves the sum of the shares
  placed in it. The shares are Ray accounting, not memory limits: on a GPU the roles take turns
  through sleep/wake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHARES = {"training": 0.34, "sampling": 0.33, "log_prob": 0.33}
READY_TIMEOUT_S = 600.0


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


@dataclass
class Placement:
    """A job's placement: device kind, and its placement group when colocated."""

    use_gpu: bool
    shape: JobShape
    colocate: bool
    group: Any = None
    _released: bool = field(default=False, repr=False)

    @classmethod
    def create(cls, *, device: str, shape: JobShape, colocate: bool) -> Placement:
        """Check the cluster can ever hold the job, then reserve its bundles when colocated.

        Raises ValueError naming the setting when the request exceeds the cluster's totals (a
        request that would wait forever otherwise), TimeoutError when the bundles stay busy.
        """
        import ray

        totals = ray.cluster_resources()
        use_gpu = _uses_gpu(device, totals)
        placement = cls(use_gpu=use_gpu, shape=shape, colocate=colocate)
        placement._check_fits(totals)
        if colocate:
            from ray.util.placement_group import placement_group

            if use_gpu:
                bundles = [{"GPU": 1.0, "CPU": 1.0} for _ in range(shape.devices)]
            else:
                bundles = [{"CPU": load} for load in shape.shares_per_device()]
            placement.group = placement_group(bundles, strategy="PACK")
            try:
                ray.get(placement.group.ready(), timeout=READY_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                placement.release()
                raise TimeoutError(
                    f"colocation: the bundles {bundles} were not free within "
                    f"{READY_TIMEOUT_S:.0f}s (available now: {ray.available_resources()})"
                ) from None
        return placement

    @property
    def device(self) -> str:
        """The torch device string inside each actor (Ray exposes its GPU as device 0)."""
        return "cuda" if self.use_gpu else "cpu"

    def options(self, role: str, index: int) -> dict:
        """``actor.options(...)`` for the ``index``-th actor of ``role``."""
        share = SHARES[role]
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=index % self.shape.devices,
            )
            resources = {"num_cpus": share, "num_gpus": share if self.use_gpu else 0}
            return {**resources, "scheduling_strategy": strategy}
        if self.use_gpu:
            return {"num_cpus": 1, "num_gpus": 1}
        return {"num_cpus": share, "num_gpus": 0}

    def release(self) -> None:
        """Give the placement group back to the cluster; idempotent."""
        if self._released:
            return
        self._released = True
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)

    def _check_fits(self, totals: dict) -> None:
        kind = "GPU" if self.use_gpu else "CPU"
        have = float(totals.get(kind, 0.0))
        shape = self.shape
        if self.use_gpu:
            actors = shape.training_workers + shape.samplers + shape.scorers
            need = float(shape.devices if self.colocate else actors)
        else:
            need = shape.total_share()
        if need > have + 1e-9:
            raise ValueError(
                f"training_config.n_gpus: the job needs {need:g} {kind} ({shape.training_workers} "
                f"training worker(s), {shape.samplers} sampler(s), {shape.scorers} log-prob "
                f"scorer(s){', colocated' if self.colocate else ''}) but the Ray cluster has "
                f"{have:g} {kind} in total"
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
