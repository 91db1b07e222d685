"""Sapiens surface-normal networks: a plain ViT backbone plus the normal head (presets 0.3b … 2b, tiny).

Backbone sizes follow the published architecture table (embed dim, layers, heads, FFN width); the
backbone alone holds ``12·d² + 13·d`` parameters per layer plus the patch embedding and the 64 × 64
position table: 0.307 / 0.636 / 1.141 / 2.134 B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from lightning_memopt.models.normal_head import NormalHead
from lightning_memopt.models.registry import register_model
from lightning_memopt.models.vit import VisionTransformer


class SapiensNormal(nn.Module):
    """Images ``[B, 3, H, W]`` → surface normals ``[B, 3, 8h, 8w]`` (``h × w`` the token grid), raw by default.

    The transformer blocks are ``backbone.blocks`` (``ViTBlock``); the head is ``head``. At the
    published 1024 × 768 input and patch 16, the 64 × 48 tokens give a 512 × 384 normal map. As in
    the official model, the output is not unit length: normalise it after resizing it to the image
    (see :func:`lightning_memopt.tasks.normal_estimation.resize_normals`).

    Args:
        head_channels: channels of the head's deconv and 1×1 conv layers (768 in the presets).
        head_conv_layers: number of 1×1 conv layers after the three deconvs (3 in the presets).
        head_dropout: rate of the head's ``Dropout2d`` before its final conv (0.1, as in the reference).
        normalize_output: return unit normals (normalised in the head, this project's earlier behaviour).
        image_size: the ``(H, W)`` input the preset is meant for: tools build example inputs of this
            size, and official checkpoints hold a position table on its token grid (any size whose
            token grid is at least 1 × 1 runs).
        **backbone_options: arguments of :class:`lightning_memopt.models.vit.VisionTransformer`:
            ``embed_dim``, ``depth``, ``num_heads``, ``ffn_dim`` (required), ``patch_size`` (16; 32
            quarters the tokens and the output size), ``patch_padding`` (2), ``position_grid`` (the
            64 × 64 pre-training grid), ``drop_path_rate`` (0 for fine-tuning in the reference),
            ``attn_impl`` (``"sdpa"`` or ``"math"``).

    Raises:
        ValueError: for a bad ``image_size`` or ``head_dropout``, inconsistent backbone sizes or an unknown
            ``attn_impl``.

    Example::

        >>> import torch
        >>> net = SapiensNormal(embed_dim=32, depth=1, num_heads=2, ffn_dim=64, position_grid=(4, 4), head_channels=8)
        >>> net(torch.randn(1, 3, 64, 48)).shape
        torch.Size([1, 3, 32, 24])
    """

    def __init__(
        self,
        head_channels: int = 768,
        head_conv_layers: int = 3,
        head_dropout: float = 0.1,
        normalize_output: bool = False,
        image_size: Sequence[int] = (1024, 768),
        **backbone_options: Any,
    ) -> None:
        super().__init__()
        if len(image_size) != 2 or min(image_size) < 1:
            raise ValueError(f"`image_size`={image_size!r} must be two positive integers (H, W)")
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.backbone = VisionTransformer(**backbone_options)
        self.head = NormalHead(
            self.backbone.embed_dim,
            deconv_channels=(head_channels,) * 3,
            conv_channels=(head_channels,) * head_conv_layers,
            dropout=head_dropout,
            normalize_output=normalize_output,
        )
        # A state dict whose position table lies on the token grid (an official checkpoint, or one of ours saved
        # after loading it) makes the model adopt that grid on any load, a resumed fit's included.
        self.register_load_state_dict_pre_hook(self._adopt_token_grid)

    def _adopt_token_grid(self, module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
        table = state_dict.get(prefix + "backbone.pos_embed")
        grid = self.backbone.token_grid(*self.image_size)
        if table is not None and table.dim() == 3 and table.shape[1] == grid[0] * grid[1]:
            self.backbone.set_position_grid(grid)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.backbone(images))


# name -> (embed dim, layers, heads, FFN width), from the published architecture table.
SAPIENS_ARCHITECTURES = {
    "sapiens_0.3b": (1024, 24, 16, 4096),
    "sapiens_0.6b": (1280, 32, 16, 5120),
    "sapiens_1b": (1536, 40, 24, 6144),
    "sapiens_2b": (1920, 48, 32, 7680),
}


def _register_sapiens_preset(name: str, architecture: tuple[int, int, int, int]) -> None:
    embed_dim, depth, num_heads, ffn_dim = architecture

    def factory(**overrides: object) -> SapiensNormal:
        options: dict = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads, "ffn_dim": ffn_dim}
        options.update(overrides)
        return SapiensNormal(**options)

    factory.__doc__ = (
        f"Sapiens preset {name}: ViT width {embed_dim}, {depth} layers, {num_heads} heads, FFN {ffn_dim},"
        " patch 16 at 1024 × 768, plus the normal head."
    )
    register_model(name)(factory)


for _name, _architecture in SAPIENS_ARCHITECTURES.items():
    _register_sapiens_preset(_name, _architecture)


@register_model("sapiens_tiny")
def sapiens_tiny(**overrides: object) -> SapiensNormal:
    """A two-block, 64-wide Sapiens on 64 × 48 inputs (4 × 3 tokens): trains a step on CPU in milliseconds."""
    options: dict = {
        "embed_dim": 64,
        "depth": 2,
        "num_heads": 2,
        "ffn_dim": 256,
        "position_grid": (4, 4),
        "head_channels": 32,
        "image_size": (64, 48),
    }
    options.update(overrides)
    return SapiensNormal(**options)
