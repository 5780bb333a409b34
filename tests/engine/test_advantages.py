"""GRPO advantages (numpy only) against hand computations and verl's pinned example."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from arctic_platform.advantages import broadcast_to_tokens, grpo_advantages


def test_verl_pinned_example():
    # verl's compute_grpo_outcome_advantage gives [0.707, -0.707, 0, 0] for {a: 1, 0}, {b: 1, 1}.
    adv = grpo_advantages([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    np.testing.assert_allclose(adv, [0.70710, -0.70710, 0.0, 0.0], atol=1e-5)
    assert adv.dtype == np.float32


def test_hand_computation_with_unbiased_std_and_epsilon():
    rewards = [3.0, 1.0, 2.0, 10.0, 4.0]
    groups = [7, 7, 7, 8, 9]  # group 9 is a singleton: mean 0, std 1
    adv = grpo_advantages(rewards, groups, epsilon=0.5)
    mean, std = 2.0, 1.0  # unbiased std of (3, 1, 2) is 1
    want = [(3 - mean) / (std + 0.5), (1 - mean) / (std + 0.5), 0.0, 10 / 1.5, 4 / 1.5]
    # group 8 is also a singleton
    np.testing.assert_allclose(adv, want, rtol=1e-6)


def test_group_size_token_rewards_and_dr_grpo():
    token_rewards = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.5, 0.5, 0.5]])
    adv = grpo_advantages(token_rewards, group_size=2, norm_by_std=False)
    np.testing.assert_allclose(adv, [1.0, -1.0, -0.5, 0.5])
    same = grpo_advantages(token_rewards.sum(1), [0, 0, 1, 1], norm_by_std=False)
    np.testing.assert_array_equal(adv, same)


def test_broadcast_over_the_response_mask():
    mask = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    out = broadcast_to_tokens(np.array([0.5, -2.0]), mask)
    np.testing.assert_array_equal(out, [[0, 0, 0.5, 0.5, 0], [0, -2, -2, -2, -2]])
    assert out.dtype == np.float32


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rewards": [1.0, float("nan")], "group_ids": [0, 0]}, "rewards"),
        ({"rewards": [1.0, 2.0], "group_ids": [0]}, "group_ids"),
        ({"rewards": [1.0, 2.0, 3.0], "group_size": 2}, "group_size"),
        ({"rewards": [1.0, 2.0]}, "group_ids/group_size"),
        ({"rewards": [1.0], "group_ids": [[1]]}, "group_ids[0]"),
        ({"rewards": np.zeros((2, 2, 2)), "group_size": 1}, "rewards"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field.replace('[', '.').replace(']', '.')}:"):
        grpo_advantages(**kwargs)


def test_imports_without_torch():
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not installed here")
                return None

        sys.meta_path.insert(0, NoTorch())
        from arctic_platform.advantages import grpo_advantages
        print(grpo_advantages([1.0, 0.0], group_size=2).tolist())
        assert "torch" not in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, second = (float(v) for v in done.stdout.strip("[]\n").split(","))
    assert first == pytest.approx(0.5 / (0.5**0.5 + 1e-6)) and second == -first
