"""The official Sapiens layout: mmpretrain ViT backbone plus mmseg ``VitNormalHead``, and MAE backbones.

The fine-tuned normal models match ours by a pure rename once our position table is on the
checkpoint's grid (the token grid of the run's ``image_size``: 64 × 48 = 3072 rows at 1024 × 768),
which the model adopts at load (:meth:`VisionTransformer.set_position_grid`). The MAE pre-training
checkpoints hold the backbone alone (keys with or without ``backbone.``), a class token and a
``1 + 64·64``-row table: the class row goes, the grid is resized to the token grid, as the reference
does at load. Export writes the table on the token grid, like the official fine-tuned model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

from torch import Tensor, nn

from lightning_memopt.models.official.layout import OfficialCheckpointError, OfficialLayout, Rename
from lightning_memopt.models.sapiens import SapiensNormal
from lightning_memopt.models.vit import resize_position_table

_POSITION_TABLE = "backbone.pos_embed"
# Sequential index of each conv in the official head's stages: [conv, InstanceNorm2d, SiLU] per stage.
_STAGE_LENGTH = 3


def _grid_text(grid: tuple[int, int]) -> str:
    return f"{grid[0]}×{grid[1]}"


class SapiensLayout(OfficialLayout):
    """facebookresearch/sapiens normal estimation (``seg/configs/sapiens_normal``) and its MAE backbones.

    Args:
        model: a :class:`SapiensNormal`.
        backbone_only: the file holds the backbone alone (MAE pre-training); its class token and MAE
            decoder (``neck.``) are dropped with their reason.

    Example::

        >>> from lightning_memopt.models.official.layout import renamed
        >>> names = ("backbone.blocks.0.ffn.0.weight", "head.upsample.2.0.weight")
        >>> [renamed(name, SapiensLayout.rules) for name in names]
        ['backbone.layers.0.ffn.layers.0.0.weight', 'decode_head.deconv_layers.6.weight']
    """

    family = "Sapiens"
    backbone_prefix = "backbone."
    rules = (
        Rename(r"^backbone\.blocks\.", "backbone.layers."),
        Rename(r"^(backbone\.layers\.\d+\.)norm([12])\.", r"\1ln\2."),
        Rename(r"^(backbone\.layers\.\d+\.ffn\.)0\.", r"\1layers.0.0."),
        Rename(r"^(backbone\.layers\.\d+\.ffn\.)2\.", r"\1layers.1."),
        Rename(r"^backbone\.norm\.", "backbone.ln1."),
        Rename(r"^backbone\.patch_embed\.", "backbone.patch_embed.projection."),
        Rename(r"^head\.upsample\.(\d+)\.0\.", lambda m: f"decode_head.deconv_layers.{_STAGE_LENGTH * int(m[1])}."),
        Rename(r"^head\.refine\.(\d+)\.0\.", lambda m: f"decode_head.conv_layers.{_STAGE_LENGTH * int(m[1])}."),
        Rename(r"^head\.predict\.", "decode_head.conv_seg."),
    )

    def __init__(self, model: nn.Module, backbone_only: bool = False) -> None:
        super().__init__(model, backbone_only)
        network = cast(SapiensNormal, model)
        self.model_grid = network.backbone.position_grid
        self.token_grid = network.backbone.token_grid(*network.image_size)

    def prepare_official(self, official: dict[str, Tensor]) -> dict[str, Tensor]:
        """A backbone-only file's keys get the ``backbone.`` prefix when none has it (bare MAEViT weights)."""
        if not self.backbone_only or any(key.startswith(self.backbone_prefix) for key in official):
            return official
        return {self.backbone_prefix + key: value for key, value in official.items()}

    def to_ours(self, name: str, value: Tensor, template: Tensor) -> Tensor:
        """A ``1 + s·s``-row table (class row, square pre-training grid) → the token grid; others kept."""
        if name != _POSITION_TABLE or value.dim() != 3 or self._table_grid(value.shape[1]) is not None:
            return value
        grid_rows = value.shape[1] - 1
        side = math.isqrt(max(grid_rows, 0))
        if grid_rows < 1 or side * side != grid_rows:
            return value
        return resize_position_table(value[:, 1:], (side, side), self.token_grid).contiguous()

    def to_official(self, name: str, value: Tensor) -> Tensor:
        """Our table on the model's grid → the official token grid; a table already on it is kept.

        Raises:
            OfficialCheckpointError: for a table on neither grid.
        """
        if name != _POSITION_TABLE:
            return value
        grid = self._table_grid(value.shape[1])
        if grid is None:
            raise OfficialCheckpointError(self._grid_message(value, "our"))
        return resize_position_table(value, grid, self.token_grid).contiguous()

    def accepts(self, name: str, value: Tensor, template: Tensor) -> bool:
        """The position table may hold the token grid or the model's grid; every other tensor its own shape."""
        if name != _POSITION_TABLE:
            return value.shape == template.shape
        return (
            value.dim() == 3
            and (value.shape[0], value.shape[2]) == (1, template.shape[2])
            and self._table_grid(value.shape[1]) is not None
        )

    def mismatch(self, name: str, value: Tensor, template: Tensor) -> str:
        """A position table that fits no grid is described by the grids it could have held."""
        if name == _POSITION_TABLE and value.dim() == 3:
            return self._grid_message(value, "the official")
        return super().mismatch(name, value, template)

    def dropped_reason(self, official_name: str) -> str | None:
        """MAE pre-training leftovers: the class token and the MAE decoder."""
        if official_name == "backbone.cls_token":
            return "class token of pre-training: the fine-tuned model has none"
        if official_name.startswith("neck."):
            return "MAE pre-training decoder"
        return None

    def load_notes(self, model: nn.Module, state_dict: Mapping[str, Tensor]) -> list[str]:
        """Says when the model adopts the token grid of a table on it (``SapiensNormal`` does so as it loads)."""
        table = state_dict.get(_POSITION_TABLE)
        backbone = cast(SapiensNormal, model).backbone
        rows = self.token_grid[0] * self.token_grid[1]
        if table is None or table.shape[1] != rows or backbone.position_grid == self.token_grid:
            return []
        return [f"position table {_grid_text(self.token_grid)} (the checkpoint's grid)"]

    def _table_grid(self, rows: int) -> tuple[int, int] | None:
        """The grid a table of ``rows`` rows lies on: the token grid first (the official one), then the model's."""
        for grid in (self.token_grid, self.model_grid):
            if rows == grid[0] * grid[1]:
                return grid
        return None

    def _grid_message(self, value: Tensor, side: str) -> str:
        token_rows, model_rows = self.token_grid[0] * self.token_grid[1], self.model_grid[0] * self.model_grid[1]
        return (
            f"{_POSITION_TABLE} {tuple(value.shape)} of {side} state dict: its {value.shape[1]} rows fit neither "
            f"the token grid {_grid_text(self.token_grid)} of `image_size`={cast(SapiensNormal, self.model).image_size}"
            f" ({token_rows} rows) nor the model's position grid {_grid_text(self.model_grid)} ({model_rows} rows)"
            + (", nor a class row plus a square pre-training grid" if side == "the official" else "")
        )
