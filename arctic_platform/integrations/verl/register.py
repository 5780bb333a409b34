"""verl's entry point into arctic-platform: registers the ``arctic`` backend and rollout replica.

verl imports this module in every process (driver, forwarder, rollout servers) when started with::

    export VERL_USE_EXTERNAL_MODULES=arctic_platform.integrations.verl.register

so it stays cheap: it registers the adapter class (light: the client config and the wire layout
code, no engines) with ``verl.remote_backend.RemoteBackendRegistry``, and *loaders* for the
forwarder worker and the rollout replica, which import them (and through them the tokenizer,
Ray actors, ...) only when verl asks for them. On a verl without ``verl.remote_backend`` the
import fails with an ImportError naming the verl that provides it (:mod:`.compat`).
"""

from __future__ import annotations

from arctic_platform.integrations.verl.compat import remote_backend_api

BACKEND_NAME = "arctic"

RemoteBackendRegistry = remote_backend_api().RemoteBackendRegistry

from verl.workers.rollout.replica import RolloutReplicaRegistry  # noqa: E402

from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper  # noqa: E402


def load_worker() -> type:
    """The forwarder worker class (imported on first use)."""
    from arctic_platform.integrations.verl.worker import ArcticRLActorRolloutRefWorker

    return ArcticRLActorRolloutRefWorker


def load_replica() -> type:
    """The rollout replica class (imported on first use)."""
    from arctic_platform.integrations.verl.rollout import ArcticRolloutReplica

    return ArcticRolloutReplica


RemoteBackendRegistry.register(BACKEND_NAME)(ArcticRLClientWrapper)
RemoteBackendRegistry.register_worker(BACKEND_NAME, load_worker)
RolloutReplicaRegistry.register(BACKEND_NAME, load_replica)
