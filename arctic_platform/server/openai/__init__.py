"""An OpenAI-compatible API (``/v1`` and, as Tinker spells it, ``/oai/api/v1``): ``completions``,
``chat/completions`` and ``models``, so evaluation harnesses (lm-eval's ``local-completions``),
the ``openai`` SDK and agents can look at any base model or checkpoint the caller may use.

It is an adapter only: :mod:`.routes` (HTTP and server-sent events), :mod:`.bodies` (the request
models and the parameters refused), :mod:`.models` (a ``model`` name -> the caller's sampling or
log-prob job on those weights), :mod:`.codec` (requests -> ``generate`` / ``log-probs`` op bodies,
op results -> OpenAI's answers) and :mod:`.errors` (OpenAI's error shape). Every op goes through
``Service.submit``, so limits, queues, metrics, auth and cancellation are the on-prem API's.
"""
