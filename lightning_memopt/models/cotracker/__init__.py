"""CoTracker2 and CoTracker3 (online, offline) point trackers: fnet, correlation, update transformer, windows."""

from lightning_memopt.models.cotracker import presets as _presets  # noqa: F401  (registers the presets)
from lightning_memopt.models.cotracker.base import CoTracker
from lightning_memopt.models.cotracker.cotracker import CoTracker2, CoTracker3, CoTracker3Offline
from lightning_memopt.models.cotracker.fnet import BasicEncoder
from lightning_memopt.models.cotracker.updateformer import UpdateFormer
from lightning_memopt.models.cotracker.windows import TrackerOutput

__all__ = [
    "BasicEncoder",
    "CoTracker",
    "CoTracker2",
    "CoTracker3",
    "CoTracker3Offline",
    "TrackerOutput",
    "UpdateFormer",
]
