"""The codec works with numpy alone: the ``client`` extra installs no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_numpy_round_trip_without_torch():
    result = run_without_torch(
        """
        import ml_dtypes, numpy as np
        from arctic_platform import wire

        obj = {
            "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
            "bf16": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
            "meta": ("x", [1, 2]),
        }
        back = wire.loads(wire.dumps(obj))
        assert back["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert back["bf16"].dtype == ml_dtypes.bfloat16
        assert back["bf16"].astype(np.float32).tolist() == [1.5, -2.0]
        assert back["meta"] == ("x", [1, 2])
        chunks = wire.encode_byte_chunks(wire.dumps(obj), kind="request", max_bytes=700)
        assert wire.loads(wire.decode_byte_chunks(chunks[::-1]))["ids"].shape == (2, 3)
        assert "torch" not in sys.modules
        try:
            wire.loads(wire.dumps(obj), tensor_type="torch")
        except ImportError as exc:
            assert "arctic-platform[engine]" in str(exc), exc
        else:
            raise AssertionError("torch decoding should need the engine extra")
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_torch_another_thread_is_still_importing_counts_as_absent():
    result = run_without_torch(
        """
        import importlib.machinery, sys, types
        import numpy as np
        from arctic_platform import wire

        # What sys.modules holds while another thread runs torch's __init__.
        half = types.ModuleType("torch")
        half.__spec__ = importlib.machinery.ModuleSpec("torch", None)
        half.__spec__._initializing = True
        sys.modules["torch"] = half
        assert not wire.is_torch_tensor(np.arange(3))
        decoded = wire.loads(wire.dumps({"x": np.arange(3)}), tensor_type="numpy")
        assert decoded["x"].tolist() == [0, 1, 2]
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
