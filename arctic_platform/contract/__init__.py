"""The API contract that client, server and engines share, defined once.

Everything here imports only the standard library, numpy and pydantic, so the client (which may be
installed without torch or FastAPI) and the server both derive from the same definitions:

* :mod:`~arctic_platform.contract.generate_columns`: generate results as tensor columns, the bulk
  form of a rollout on the wire.
* :mod:`~arctic_platform.contract.job_sections` and :mod:`~arctic_platform.contract.legacy_config`:
  the jobs part of a client config and the folding of the reference (legacy) config shapes into
  it, read alike by the client's config and the on-prem server's reference ``/initialize``.
"""
