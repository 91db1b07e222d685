"""Model presets and the registry that builds them by name."""

from lightning_memopt.models import iresnet as _iresnet  # noqa: F401  (registers the face presets)
from lightning_memopt.models.cotracker import (  # registers the CoTracker presets
    CoTracker2,
    CoTracker3,
    CoTracker3Offline,
    TrackerOutput,
)
from lightning_memopt.models.iresnet import IBasicBlock, IResNet
from lightning_memopt.models.official import (
    OfficialCheckpointError,
    convert_official_state_dict,
    load_pretrained,
    to_official_state_dict,
)
from lightning_memopt.models.registry import create_model, list_models, register_model
from lightning_memopt.models.sapiens import SapiensNormal  # registers the Sapiens presets
from lightning_memopt.models.vit import VisionTransformer, ViTBlock

__all__ = [
    "CoTracker2",
    "CoTracker3",
    "CoTracker3Offline",
    "IBasicBlock",
    "IResNet",
    "OfficialCheckpointError",
    "SapiensNormal",
    "TrackerOutput",
    "ViTBlock",
    "VisionTransformer",
    "convert_official_state_dict",
    "create_model",
    "list_models",
    "load_pretrained",
    "register_model",
    "to_official_state_dict",
]
