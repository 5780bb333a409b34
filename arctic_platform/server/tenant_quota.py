"""How much one tenant may hold at once: live jobs, the bytes of the models they load, and the
bytes of the checkpoints they saved.

Per-request limits (:mod:`arctic_platform.server.limits`) bound one op; they do not stop a tenant
from creating job after job, each holding loaded models (one tenant made 15 jobs, 30 models, and
nothing refused it). A job counts from its creation until it ends (failed, cancelled, terminated),
on every API that creates jobs: the on-prem ``/initialize``, the Cortex create-job, and the Tinker
training clients and model samplers (each one job). Beyond a quota ``create job`` is refused with
409 ``limit_exceeded`` naming the limit and its ``serve`` flag: the refusal is about what the
tenant holds now, which retrying does not change (429 would make clients retry), and cancelling
one of its jobs lifts it.

Checkpoints outlive their jobs, so they are bounded apart: every API's saves land on the server's
one disk, and a tenant saving in a loop would otherwise fill it, and every other tenant's next save
would fail (507) and cost them their run. A save is refused, before anything is written, once
what the tenant's saves keep (its tenant folder, and its catalogued checkpoints outside it) and
this save, estimated as the size of its job's largest checkpoint, would pass
``max_checkpoint_bytes_per_tenant``; deleting checkpoints lifts it. A job's first save has no
estimate and saves that run at once each count only what is saved already, so the bound can be
passed by what those saves write; a save under ``--allow-write-path`` is counted while its
catalogue record is its (a later save of the same id elsewhere replaces it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from arctic_platform.contract.ops import OpName
from arctic_platform.server.errors import Conflict

# ``serve --max-jobs-per-tenant``: more than one person's experiments at once (a driver holds one
# job, a Tinker script a few), far fewer than a server's memory holds.
DEFAULT_MAX_JOBS_PER_TENANT = 8
# Weight files: what ``from_pretrained`` loads into memory (tokenizers and configs are small).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class TenantQuota:
    """Per-tenant bounds (flag names are the field names with dashes); None: no bound."""

    max_jobs_per_tenant: int | None = None
    max_model_bytes_per_tenant: int | None = None
    max_checkpoint_bytes_per_tenant: int | None = None

    def check(self, *, jobs: int, model_bytes: int) -> None:
        """Refuse a new job that would give its tenant ``jobs`` live jobs loading ``model_bytes``
        of weights in all (the new job included)."""
        self._bound("live jobs", jobs, "max_jobs_per_tenant")
        self._bound("bytes of model weights", model_bytes, "max_model_bytes_per_tenant")

    def check_checkpoints(self, *, held: int, estimate: int) -> None:
        """Refuse a save by a tenant whose checkpoints hold ``held`` bytes, this one estimated
        at ``estimate``."""
        self._bound(
            "bytes of checkpoints",
            held + estimate,
            "max_checkpoint_bytes_per_tenant",
            op=OpName.SAVE,
            detail=f" ({held} saved, about {estimate} for this one)",
            remedy="delete checkpoints you no longer need",
        )

    def _bound(
        self,
        what: str,
        value: int,
        limit: str,
        *,
        op: str = "create job",
        detail: str = "",
        remedy: str = "cancel a job you no longer use",
    ) -> None:
        bound = getattr(self, limit)
        if bound is not None and value > bound:
            flag = "--" + limit.replace("_", "-")
            raise Conflict(
                f"{op}: it would give you {value} {what}{detail}, more than this server's limit "
                f"of {bound} per tenant ({flag}); {remedy}",
                code="limit_exceeded",
                limit=limit,
                value=value,
                maximum=bound,
            )


def weight_bytes(model_dir: str | None) -> int:
    """The size of the weight files in a local model folder (0 for anything else: a hub name not
    downloaded yet is measured once it is)."""
    if model_dir is None:
        return 0
    folder = Path(model_dir)
    if not folder.is_dir():
        return 0
    files = [f for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    if any(f.suffix == ".safetensors" for f in files):  # what from_pretrained then loads
        files = [f for f in files if f.suffix == ".safetensors"]
    return sum(f.stat().st_size for f in files)
