"""A Tinker-compatible API on ``arctic-platform serve``: the ``tinker`` SDK and tinker-cookbook run
unmodified against this server (``base_url=``), on our Service, engines, auth and tenants.

Modules: :mod:`.routes` (HTTP), :mod:`.operations` (each op on the Service), :mod:`.losses`
(Tinker datums and losses on our engine), :mod:`.codec`/:mod:`.proto` (the SDK's protobuf
bodies), :mod:`.futures` (request ids and long-polled retrieval), :mod:`.state` (sessions, runs,
samplers, ``seq_id`` order), :mod:`.checkpoints` (``tinker://`` paths).
"""
