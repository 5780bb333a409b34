"""The vLLM sampling backend: vLLM in its own process, behind the same sampling job.

vLLM cannot share our environment (it pins a ``transformers`` we cannot use, and on CPU it
replaces ``torch.set_num_threads`` process-wide), so it runs as a separate process started from an
interpreter the operator names:

- :mod:`.worker` is the script that process runs; it imports only the standard library and vLLM.
- :mod:`.process` starts it, talks to it over a Unix socket pair (one JSON message per line) and
  turns its death into :class:`~.process.VllmWorkerDied`.
- :mod:`.staging` keeps the current weights as a model directory the worker loads from.
- :mod:`.engine` is :class:`~.engine.VllmSamplingEngine`, the sampling engine the job holds.
"""
