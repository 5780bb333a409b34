"""With only the ``client`` extra (no torch, FastAPI or Ray), a driver trains over HTTP and Cortex.

A subprocess makes torch, FastAPI, uvicorn and Ray unimportable (a meta-path finder raising
ImportError), imports ``arctic_platform.rl``, ``arctic_platform.client`` and
``arctic_platform.wire``, and runs generate, fwd_no_grad, fwd_bwd and step with numpy arrays
against our server, which runs in this test process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_HEAVY = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = ("torch", "fastapi", "starlette", "uvicorn", "ray", "transformers")

    class _ClientOnly(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: client-only install")
            return None

    sys.meta_path.insert(0, _ClientOnly())
    """
)

DRIVER = textwrap.dedent(
    """
    import numpy as np
    import arctic_platform.rl as rl
    import arctic_platform.client
    from arctic_platform import wire
    from arctic_platform.advantages import grpo_advantages
    from arctic_platform.layout import training_batch

    URL = sys.argv[1]
    backends = {
        "http": {"type": "http", "url": URL},
        "cortex": {"type": "cortex", "base_url": URL, "database": "DB", "schema": "RL",
                   "poll_interval": 0.01, "poll_max_interval": 0.05},
    }
    prompts = [[40, 41, 42]]
    for name, backend in backends.items():
        config = rl.ArcticRLClientConfig(
            model="builtin:tiny", seed=4, backend=backend,
            training={"optimizer": {"lr": 1e-3}}, sampling={},
        )
        with rl.create_arctic_rl_client(config, blocking_calls=True) as client:
            results = client.generate(prompts, {"n": 4, "max_tokens": 5, "seed": 2})
            rewards = [float(np.mean(r["token_ids"])) for r in results]
            batch = training_batch(
                prompts * 4, [r["token_ids"] for r in results], pad_token_id=0,
                advantages=grpo_advantages(rewards, group_size=4),
            )
            old = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
            assert isinstance(old, np.ndarray) and old.shape == batch["input_ids"].shape, name
            batch["old_log_probs"] = old * batch["response_mask"]
            fwd_bwd = client.fwd_bwd({"batch": batch, "processing": {"loss_fn": "verl_grpo"}})
            step = client.step()
            assert step["global_steps"] == 1 and step["grad_norm"] > 0, (name, step)
            assert set(fwd_bwd) == {"job_id", "loss", "avg_loss", "metrics"}, name
            print(name, "ok", flush=True)

    for backend, extra in (("inprocess", "engine"), ("ray", "ray")):
        config = {"model": "builtin:tiny", "backend": {"type": backend}}
        try:
            rl.create_arctic_rl_client(config)
        except ImportError as exc:
            assert f"arctic-platform[{extra}]" in str(exc), exc
        else:
            raise AssertionError(f"{backend} should need the {extra} extra")
    assert wire.loads(wire.dumps({"x": np.arange(3)}))["x"].tolist() == [0, 1, 2]
    heavy = [m for m in ("torch", "fastapi", "uvicorn", "ray") if m in sys.modules]
    assert not heavy, heavy
    print("done")
    """
)


def test_client_only_driver_trains_over_http_and_cortex(server_url):
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_HEAVY + DRIVER, server_url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["http", "ok", "cortex", "ok", "done"]


def test_rl_import_is_lazy():
    code = (
        "import sys, arctic_platform.rl as rl; "
        "heavy = ('torch', 'fastapi', 'ray', 'httpx', 'pydantic'); "
        "print([m for m in heavy if m in sys.modules]); rl.create_arctic_rl_client; "
        "print(sorted(m for m in ('torch', 'fastapi', 'ray') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "[]"]
