"""A request's ``processing``: the post-processors that score its tokens and the loss that trains
on them, by name, checked without torch.

The post-processors and losses themselves are the engine's torch code, registered by name when
its modules are imported (``engine.postprocess.register_post_processor``,
``engine.losses.register_loss``). Their *names* live here, in two registries those decorators
fill, so that a server process that has no engine of its own (engines on Ray workers, in a vLLM
process, or not built yet) refuses an unknown name with a 400 naming the field when the request
is submitted, without importing torch. The built-in names are defined here once and the engine
registers its code under them; a custom loss registered in this process is known from the import
of its module on (one registered only in another process is not, as before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.contract.problems import FieldError

# Post-processors (engine/postprocess.py). verl names ENTROPY_AND_LOGPROBS for log-probs and
# entropies; the Cortex contract's LOGPROBS is the same step.
IDENTITY = "identity"
APPLY_TEMPERATURE = "apply_temperature"
ENTROPY_AND_LOGPROBS = "compute_entropy_and_logprobs"
LOGPROBS = "compute_logprobs"
# Temperature, then log-probs: ``forward`` and ``forward_backward`` score tokens alike unless a
# client names other steps.
DEFAULT_POST: tuple[str, ...] = (APPLY_TEMPERATURE, ENTROPY_AND_LOGPROBS)

# Losses (engine/losses/).
VERL_GRPO = "verl_grpo"
GRPO = "grpo"
GRPO_ECHO = "grpo_echo_v1"
CROSS_ENTROPY = "cross_entropy"
# Tinker's policy losses, one ratio loss in four forms (engine/losses/ppo.py).
RATIO_LOSSES: tuple[str, ...] = ("importance_sampling", "ppo", "cispo", "dro")


class Names:
    """The names registered for one kind of step (module doc); starts with the built-ins."""

    def __init__(self, kind: str, builtin: Iterable[str]) -> None:
        self.kind = kind
        self._names = set(builtin)

    def add(self, name: str) -> None:
        self._names.add(name)

    def known(self) -> list[str]:
        return sorted(self._names)

    def check(self, name: str, field_name: str) -> None:
        """``name`` is registered; otherwise a :class:`FieldError` naming ``field_name``."""
        if not isinstance(name, str):
            raise FieldError(field_name, f"expected a {self.kind} name, got {name!r}")
        if name not in self._names:
            known = ", ".join(self.known())
            raise FieldError(field_name, f"unknown {self.kind} {name!r}; known: {known}")


POST_PROCESSOR_NAMES = Names("post-processor", (IDENTITY, *DEFAULT_POST, LOGPROBS))
LOSS_NAMES = Names("loss", (VERL_GRPO, GRPO, GRPO_ECHO, CROSS_ENTROPY, *RATIO_LOSSES))


@dataclass(frozen=True)
class Processing:
    """Typed ``processing``: post-processor names, the loss name (``None``: no loss), its config."""

    post: tuple[str, ...] = DEFAULT_POST
    loss_fn: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


def parse_processing(processing: Mapping | None, *, default_loss: str | None) -> Processing:
    """Check ``processing``; an absent ``loss_fn`` means ``default_loss``, an explicit None none.
    Post-processor and loss names must be registered (:data:`POST_PROCESSOR_NAMES`,
    :data:`LOSS_NAMES`)."""
    if processing is None:
        return Processing(loss_fn=default_loss)
    if not isinstance(processing, Mapping):
        raise FieldError("processing", f"expected a dict, got {type(processing).__name__}")
    unknown = set(processing) - {"post", "loss_fn", "config"}
    if unknown:
        raise FieldError(
            f"processing.{sorted(unknown)[0]}", "unknown key (expected post, loss_fn, config)"
        )
    post = processing.get("post")
    if post is None:
        post = DEFAULT_POST
    if isinstance(post, str) or not isinstance(post, (list, tuple)):
        raise FieldError("processing.post", "expected a list of post-processor names")
    for i, name in enumerate(post):
        POST_PROCESSOR_NAMES.check(name, f"processing.post[{i}]")
    loss_fn = processing.get("loss_fn", default_loss)
    if loss_fn is not None:
        LOSS_NAMES.check(loss_fn, "processing.loss_fn")
    config = processing.get("config") or {}
    if not isinstance(config, Mapping):
        raise FieldError("processing.config", "expected a dict")
    return Processing(post=tuple(post), loss_fn=loss_fn, config=dict(config))
