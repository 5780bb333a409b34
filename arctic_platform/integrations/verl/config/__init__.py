"""Hydra config folder of the verl integration (``pkg://arctic_platform.integrations.verl.config``).

It holds the ``remote_backend`` group with the ``arctic`` option; the package marker lets Hydra
find it with a ``pkg://`` search path once arctic-platform is installed.
"""
