"""arctic-platform: one client for the heavy compute of RL post-training.

Importing the top-level package is cheap on purpose (no torch, no FastAPI, no Ray): frameworks
import it in every process. Use the subpackages: :mod:`arctic_platform.wire` (the DSSST1 codec),
:mod:`arctic_platform.client`, :mod:`arctic_platform.rl`, :mod:`arctic_platform.engine`,
:mod:`arctic_platform.server`.
"""

__version__ = "0.2.0.dev0"
