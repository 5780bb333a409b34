"""The Tinker API over plain HTTP, without the SDK: for tests that send what the SDK would not
(bad names) or kill the server under a client (the SDK's background threads would keep calling a
dead server), and for ``benchmarks/chaos.py``.

Each method sends one request and returns what the server answered; :meth:`TinkerHttp.result`
polls a future the way the SDK does (408 ``try_again`` means poll again).
"""

from __future__ import annotations

import time

import httpx

PROTOBUF = "application/x-protobuf"


class TinkerHttp:
    """One tenant's plain HTTP client of a server's ``/api/v1`` (see module doc)."""

    def __init__(self, url: str, api_key: str, *, timeout: float = 120) -> None:
        self.http = httpx.Client(
            base_url=f"{url}/api/v1", headers={"X-API-Key": api_key}, timeout=timeout
        )

    def close(self) -> None:
        self.http.close()

    def post(self, route: str, body: dict) -> httpx.Response:
        return self.http.post(f"/{route}", json=body)

    def submit(self, route: str, body: dict) -> str:
        """POST an op that answers a future; its request id (raises on a refusal)."""
        response = self.post(route, body)
        response.raise_for_status()
        return response.json()["request_id"]

    def result(self, request_id: str, *, timeout: float = 300) -> httpx.Response:
        """The future's final answer: JSON (a result or ``{"error", "category"}``) or a
        protobuf body."""
        deadline = time.monotonic() + timeout
        while True:
            response = self.post("retrieve_future", {"request_id": request_id})
            if response.status_code != 408:
                return response
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} still running after {timeout} s")

    def ok(self, request_id: str) -> dict:
        """The JSON result of a future that must succeed."""
        response = self.result(request_id)
        response.raise_for_status()
        body = response.json()
        assert "error" not in body, body
        return body

    def session(self) -> str:
        return self.post("create_session", {}).json()["session_id"]

    def training_run(self, session: str, base_model: str, *, rank: int = 4, seq: int = 0) -> str:
        """A LoRA training client's model id, once its engines are up."""
        body = {
            "session_id": session,
            "model_seq_id": seq,
            "base_model": base_model,
            "lora_config": {"rank": rank, "seed": 0},
        }
        return self.ok(self.submit("create_model", body))["model_id"]

    def save(self, route: str, model_id: str, name: str, **extra) -> httpx.Response:
        """``save_weights`` / ``save_weights_for_sampler`` / ``save_weights_external`` of
        ``name``: the route's answer (a future, or a refusal)."""
        return self.post(route, {"model_id": model_id, "path": name, **extra})

    def sample(self, session: str, model_path: str, tokens: list[int], *, seq: int = 0):
        """One greedy sample from a saved checkpoint: the create-session answer if it was
        refused, else the future's answer (a protobuf ``SampleResponse`` when it worked)."""
        created = self.post(
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": seq, "model_path": model_path},
        )
        if created.status_code != 200:
            return created
        body = {
            "sampling_session_id": created.json()["sampling_session_id"],
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0.0},
        }
        return self.result(self.submit("asample", body))

    def checkpoints(self, model_id: str) -> list[dict]:
        response = self.http.get(f"/training_runs/{model_id}/checkpoints")
        response.raise_for_status()
        return response.json()["checkpoints"]
