"""Model presets and the registry that builds them by name."""

from lightning_memopt.models import iresnet as _iresnet  # noqa: F401  (registers the face presets)
from lightning_memopt.models.cotracker import CoTracker2, CoTracker3, TrackerOutput  # registers the CoTracker presets
from lightning_memopt.models.iresnet import IBasicBlock, IResNet
from lightning_memopt.models.registry import create_model, list_models, register_model
from lightning_memopt.models.sapiens import SapiensNormal  # registers the Sapiens presets
from lightning_memopt.models.vit import VisionTransformer, ViTBlock

__all__ = [
    "CoTracker2",
    "CoTracker3",
    "IBasicBlock",
    "IResNet",
    "SapiensNormal",
    "TrackerOutput",
    "ViTBlock",
    "VisionTransformer",
    "create_model",
    "list_models",
    "register_model",
]
