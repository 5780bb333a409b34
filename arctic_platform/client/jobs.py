"""Managing a server's jobs from outside a training run: ``arctic-platform jobs`` is built on it.

:class:`JobsClient` calls the on-prem ``/jobs`` routes of ``arctic-platform serve``
(:mod:`arctic_platform.server.jobs_api`); :class:`CortexJobsClient` the same control plane of a
Cortex-style API (list, get, ``:cancel``, checkpoints, ``:export``, the ``tail-logs``
operation), which has no route for a job's create request. Either sends the caller's token, so it
sees exactly the jobs that token owns. :func:`server_from` finds the server: an explicit URL and
token variable (an on-prem server), or the ``backend`` of a client config or recipe YAML
(``http`` or ``cortex``); :func:`jobs_client` picks the client for it. Errors are the client's
:class:`~arctic_platform.client.errors.ServerError` family, carrying the server's message.
:class:`JobsClient` calls the on-prem ``/jobs`` routes of ``arctic-platform serve``
(:mod:`arctic_platform.server.jobs_api`) with the caller's bearer token, so it sees exactly the
jobs that token owns. :func:`server_from` finds the server: an explicit URL and token variable, or
the ``backend`` section of a client config or recipe YAML. Errors are the client's
:class:`~arctic_platform.client.errors.ServerError` family, carrying the server's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from arctic_platform.client.errors import ArcticRLError
from arctic_platform.client.transports.http_common import error_from_response
from arctic_platform.contract.ops import OpName

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerAddress:
    """Where the server is and which environment variable holds the caller's token; ``cortex``
    when it is a Cortex-style API (the YAML's ``cortex`` backend)."""

    url: str
    token_env: str | None = None
    cortex: Any = None  # a CortexBackend
    verify_tls: bool = True


def server_from(
    url: str | None, token_env: str | None, config: str | os.PathLike | None
) -> ServerAddress:
    """``--url``/``--token-env``, else the ``backend`` of ``config`` (a client config YAML, or a
    recipe YAML whose ``client`` section holds it); the options override the YAML's."""
    from arctic_platform.client.config import check_url

    if url is None and config is None:
        raise ValueError("--url or --config: say which server to ask")
    backend = _backend_of(config) if config is not None else None
    if backend is not None and backend.type == "cortex":
        if url is not None or token_env is not None:
            raise ValueError(
                "--url/--token-env: not with a cortex backend; its YAML says where the API is "
                "(base_url or host) and which variable holds the token (pat_env_var)"
            )
        return ServerAddress(url=backend.prefix, cortex=backend, verify_tls=backend.verify_tls)
    if url is None:
        url = backend.base_url
    else:
        check_url("--url", url)
    if token_env is None and backend is not None:
        token_env = backend.token_env
    return ServerAddress(url=url.rstrip("/"), token_env=token_env)


def jobs_client(address: ServerAddress) -> JobsClient:
    """The client for the API at ``address``."""
    return CortexJobsClient(address) if address.cortex is not None else JobsClient(address)


def _backend_of(path: str | os.PathLike):
    from arctic_platform.client.config import ArcticRLClientConfig
    from arctic_platform.client.yaml_files import load_mapping

    source = Path(path)
    data = load_mapping(source)
    if isinstance(data.get("client"), dict):
        data = data["client"]  # a recipe: its client section
    backend = ArcticRLClientConfig.model_validate(data).backend
    if backend.type not in ("http", "cortex"):
        raise ValueError(
            f"{source}: backend.type is {backend.type!r}; arctic-platform jobs talks to a server "
            "(backend type http or cortex), or pass --url"
        )
    return backend


class JobsClient:
    """The ``/jobs`` routes of one server, as the caller's token sees them."""

    def __init__(self, address: ServerAddress, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = address.url
        self._verify = address.verify_tls
        self._http = httpx.Client(
            base_url=address.url,
            headers=self._auth_headers(address),
            timeout=timeout,
            verify=address.verify_tls,
        )

    def _auth_headers(self, address: ServerAddress) -> dict[str, str]:
        if address.token_env is None:
            return {}
        token = os.environ.get(address.token_env)
        if not token:
            raise ValueError(
                f"--token-env {address.token_env}: the environment variable is unset or empty"
            )
        return {"Authorization": f"Bearer {token}"}

    def __enter__(self) -> JobsClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def list(self, status: str | None = None) -> dict[str, Any]:
        """``{"jobs": [...], "now": server time}``."""
        return self._json("GET", "/jobs", what="list", params={"status": status} if status else {})

    def show(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{_segment(job_id)}", what="show")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{_segment(job_id)}/cancel", what="cancel")

    def logs(self, job_id: str, cursor: str | None = None, max_lines: int = 200) -> dict[str, Any]:
        params: dict[str, Any] = {"max_lines": max_lines}
        if cursor is not None:
            params["cursor"] = cursor
        return self._json("GET", f"/jobs/{_segment(job_id)}/logs", what="logs", params=params)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        path = f"/jobs/{_segment(job_id)}/checkpoints"
        return self._json("GET", path, what="checkpoints")["checkpoints"]

    def checkpoint_files(self, job_id: str, checkpoint_id: str) -> list[dict[str, Any]]:
        path = f"/jobs/{_segment(job_id)}/checkpoints/{_segment(checkpoint_id)}/files"
        return self._json("GET", path, what="export")["files"]

    def download(self, job_id: str, checkpoint_id: str, filename: str, target: Path) -> int:
        """Stream one checkpoint file to ``target``; its size in bytes."""
        url = self._download_url(job_id, checkpoint_id, filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        try:
            with self._stream(url) as response:
                if response.status_code >= 400:
                    raise error_from_response(response.status_code, response.read(), op="export")
                with partial.open("wb") as handle:
                    for chunk in response.iter_bytes():
                        handle.write(chunk)
        except httpx.TransportError as exc:
            raise ArcticRLError(f"export: download of {filename} failed: {exc}") from None
        partial.replace(target)
        return target.stat().st_size

    def _download_url(self, job_id: str, checkpoint_id: str, filename: str) -> str:
        files = f"/jobs/{_segment(job_id)}/checkpoints/{_segment(checkpoint_id)}/files/"
        return files + quote(filename)

    def _stream(self, url: str):
        """GET ``url`` streamed: relative URLs with this client's token, absolute ones bare."""
        if url.startswith(("http://", "https://")):
            return httpx.stream("GET", url, timeout=self._http.timeout, verify=self._verify)
        return self._http.stream("GET", url)

    def export(self, job_id: str, checkpoint_id: str | None, output: Path) -> Iterator[dict]:
        """Download a checkpoint (default: the job's newest) into ``output``; yields each file
        as it lands (``filename``, ``size_bytes``, ``path``)."""
        if checkpoint_id is None:
            saved = self.checkpoints(job_id)
            if not saved:
                raise ArcticRLError(f"export: job {job_id} has no checkpoint")
            checkpoint_id = max(saved, key=lambda c: c["created_at"])["checkpoint_id"]
        root = output.resolve()
        for entry in self.checkpoint_files(job_id, checkpoint_id):
            target = (root / entry["filename"]).resolve()
            if not target.is_relative_to(root):
                raise ArcticRLError(f"export: file name {entry['filename']!r} leaves {output}")
            size = self.download(job_id, checkpoint_id, entry["filename"], target)
            yield {
                "checkpoint_id": checkpoint_id,
                "filename": entry["filename"],
                "size_bytes": size,
                "path": str(target),
            }

    def _json(self, method: str, path: str, *, what: str, **kwargs) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ArcticRLError(f"{what}: cannot reach {self.url}: {exc}") from None
        if response.status_code >= 400:
            raise error_from_response(response.status_code, response.content, op=what)
        try:
            return response.json()
        except ValueError:
            raise ArcticRLError(
                f"{what}: {response.request.url} answered HTTP {response.status_code} without a "
                "JSON body; is this an arctic-platform server?"
            ) from None


def _segment(value: str) -> str:
    """An id as one URL path segment (a ``/`` in it cannot address another route)."""
    return quote(value, safe=":")


class CortexJobsClient(JobsClient):
    """The same operations over a Cortex-style API (the prefix ``.../{endpoint}`` is the base).

    Ages use this machine's clock (the API reports no server time), ``show`` has no ``config``
    (the API does not return a job's create request), and checkpoint files come from the
    ``:export`` route's download URLs.
    """

    def __init__(self, address: ServerAddress, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(address, timeout=timeout)
        self._exports: dict[tuple[str, str], dict[str, str]] = {}

    def _auth_headers(self, address: ServerAddress) -> dict[str, str]:
        from arctic_platform.client.transports.cortex import PAT_TYPE, PAT_TYPE_HEADER

        token = address.cortex.resolve_pat()
        return (
            {} if token is None else {"Authorization": f"Bearer {token}", PAT_TYPE_HEADER: PAT_TYPE}
        )

    def list(self, status: str | None = None) -> dict[str, Any]:
        params = {"status": status} if status else {}
        answer = self._json("GET", self.url, what="list", params=params)  # no trailing slash
        return {"jobs": answer["jobs"], "now": time.time()}

    def show(self, job_id: str) -> dict[str, Any]:
        info = self._json("GET", f"/{_segment(job_id)}", what="show")
        return {**info, "config": None, "checkpoints": self.checkpoints(job_id), "now": time.time()}

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/{_segment(job_id)}:cancel", what="cancel")

    def logs(self, job_id: str, cursor: str | None = None, max_lines: int = 200) -> dict[str, Any]:
        payload: dict[str, Any] = {"max_lines": max_lines}
        if cursor is not None:
            payload["cursor"] = cursor
        body = {"operation_type": OpName.TAIL_LOGS, "payload": payload}
        return self._json("POST", f"/{_segment(job_id)}/operation", what="logs", json=body)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._json("GET", f"/{_segment(job_id)}/checkpoints", what="checkpoints")[
            "checkpoints"
        ]

    def checkpoint_files(self, job_id: str, checkpoint_id: str) -> list[dict[str, Any]]:
        path = f"/{_segment(job_id)}/checkpoints/{_segment(checkpoint_id)}:export"
        files = self._json("POST", path, what="export")["files"]
        self._exports[(job_id, checkpoint_id)] = {f["filename"]: f["url"] for f in files}
        return [{"filename": f["filename"], "size_bytes": f["size_bytes"]} for f in files]

    def _download_url(self, job_id: str, checkpoint_id: str, filename: str) -> str:
        """The export's signed URL: the credential itself, so no token goes with it."""
        return self._exports[(job_id, checkpoint_id)][filename]
