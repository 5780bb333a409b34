"""The unified client: one op surface, four backends, chosen in the config.

    from arctic_platform.client import create_arctic_rl_client

    client = create_arctic_rl_client("rl.yaml", blocking_calls=True)
    results = client.generate(["2+2="], {"n": 4, "max_tokens": 8})
    ...
    client.fwd_bwd({"batch": batch, "meta": meta, "processing": {"loss_fn": "verl_grpo"}})
    client.step()
    client.sync_weights()

Importing this package needs only the ``client`` extra (no torch, FastAPI or Ray); each backend
loads its own dependencies when chosen.
"""

from arctic_platform.client.client import ArcticRLClient, SyncArcticRLClient
from arctic_platform.client.config import (
    ArcticRLClientConfig,
    CortexBackend,
    HttpBackend,
    InferenceJob,
    InProcessBackend,
    LoraSettings,
    OptimizerSettings,
    RayBackend,
    ScheduleSettings,
    TrainingJob,
    load_config,
)
from arctic_platform.client.errors import (
    ArcticRLError,
    AuthenticationError,
    BackendUnavailableError,
    ChunkGroupError,
    ConflictError,
    InvalidRequestError,
    JobNotConfiguredError,
    NotFoundError,
    RequestTimeoutError,
    ServerError,
    TransportError,
)
from arctic_platform.client.factory import apply_env_override, create_arctic_rl_client
from arctic_platform.client.transport import OPS, JobHandles, Request, Transport
from arctic_platform.client.transports import make_transport
from arctic_platform.client.transports.liveness import ServerUnresponsiveError
from arctic_platform.client.transports.mock import MockTransport

__all__ = [
    "OPS",
    "ArcticRLClient",
    "ArcticRLClientConfig",
    "ArcticRLError",
    "AuthenticationError",
    "BackendUnavailableError",
    "ChunkGroupError",
    "ConflictError",
    "CortexBackend",
    "HttpBackend",
    "InProcessBackend",
    "InferenceJob",
    "InvalidRequestError",
    "JobHandles",
    "JobNotConfiguredError",
    "LoraSettings",
    "MockTransport",
    "NotFoundError",
    "OptimizerSettings",
    "RayBackend",
    "Request",
    "RequestTimeoutError",
    "ScheduleSettings",
    "ServerError",
    "ServerUnresponsiveError",
    "SyncArcticRLClient",
    "TrainingJob",
    "Transport",
    "TransportError",
    "apply_env_override",
    "create_arctic_rl_client",
    "load_config",
    "make_transport",
]
