"""The request bodies of ``completions`` and ``chat/completions``, and the parameters refused.

A parameter we do not implement is a 400 naming it (``param``), never silently ignored: an
evaluation whose ``presence_penalty`` was dropped would report numbers for another setting.
Such a parameter at its neutral value (what OpenAI does when it is left out) is accepted, because
some clients send every parameter with its default. ``null`` means "left out" for every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from arctic_platform.server.errors import BadRequest

# OpenAI parameters we do not implement, with the value that means "off".
NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "best_of": 1,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "parallel_tool_calls": False,
}

# OpenAI's largest top-log-probs count (chat ``top_logprobs``; completions ``logprobs``).
MAX_TOP_LOGPROBS = 20

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if v is not None}
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class _Request(_Body):
    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Request):
    """``POST /completions``: ``prompt`` is a text, texts, token ids, or lists of token ids."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts as the ``generate`` op takes them (one entry per prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[TextPart] = ""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """``POST /chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def parse(model: type[_Body], raw: Any) -> Any:
    """``raw`` as ``model``: a 400 naming the first bad or unsupported parameter."""
    if not isinstance(raw, dict):
        raise BadRequest("the body must be a JSON object", param=None)
    try:
        parsed = model.model_validate(raw)
    except ValidationError as exc:
        problems = [
            (".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors(include_url=False)
        ]
        message = "; ".join(f"{where}: {msg}" for where, msg in problems)
        raise BadRequest(message, param=problems[0][0]) from None
    refused = _unsupported(parsed)
    for i, message in enumerate(getattr(parsed, "messages", ())):
        refused += [f"messages.{i}.{key}" for key in sorted(message.model_extra or {})]
    if refused:
        raise BadRequest(
            f"unsupported parameter(s): {', '.join(refused)} (this server implements "
            f"{', '.join(sorted(model.model_fields))}; unsupported ones are accepted only at "
            "their neutral value)",
            param=refused[0],
            code="unsupported_parameter",
        )
    return parsed


def _unsupported(parsed: BaseModel) -> list[str]:
    extra = parsed.model_extra or {}
    return sorted(k for k, v in extra.items() if k not in NEUTRAL or v != NEUTRAL[k])
