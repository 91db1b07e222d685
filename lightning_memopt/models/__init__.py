"""Model presets and the registry that builds them by name."""

from lightning_memopt.models import iresnet as _iresnet  # noqa: F401  (registers the face presets)
from lightning_memopt.models.iresnet import IBasicBlock, IResNet
from lightning_memopt.models.registry import create_model, list_models, register_model

__all__ = ["IBasicBlock", "IResNet", "create_model", "list_models", "register_model"]
