"""The official CoTracker layouts (facebookresearch/co-tracker): CoTracker2, and CoTracker3 online and offline.

The official modules carry other names (``fnet.layer1`` for ``fnet.stages.0``, ``updateformer.virual_tracks``
(sic), ``space_point2virtual_blocks`` …); CoTracker3's ``flow_head`` (Δx, Δy) and ``vis_conf_head``
(Δvisibility, Δconfidence) are the two halves of our ``output_head``. The official files also hold the
sinusoidal tables the model computes: ``time_emb`` [1, window_len, D] and, for CoTracker2,
``pos_emb`` [1, D, h, w] over the integer feature grid; they are regenerated on export and checked
on import (a table made for another window length or resolution is refused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_memopt.models.cotracker import CoTracker, CoTracker2
from lightning_memopt.models.cotracker.embeddings import sincos_embedding_2d
from lightning_memopt.models.official.layout import OfficialLayout, Rename

# ours → official, shared by both versions (applied in order)
_COMMON_RULES = (
    Rename(r"^fnet\.stem\.0\.", "fnet.conv1."),
    Rename(r"^fnet\.stages\.(\d+)\.", lambda match: f"fnet.layer{int(match[1]) + 1}."),
    Rename(r"\.shortcut\.", ".downsample."),
    Rename(r"^fnet\.fuse\.0\.", "fnet.conv2."),
    Rename(r"^fnet\.project\.", "fnet.conv3."),
    Rename(r"^updateformer\.virtual_tracks$", "updateformer.virual_tracks"),
    Rename(r"\.mlp\.0\.", ".mlp.fc1."),
    Rename(r"\.mlp\.2\.", ".mlp.fc2."),
    Rename(r"_virtual_from_point_blocks\.", "_virtual2point_blocks."),
    Rename(r"_point_from_virtual_blocks\.", "_point2virtual_blocks."),
    Rename(r"2(point|virtual)_blocks\.(\d+)\.attn\.", r"2\1_blocks.\2.cross_attn."),
)


class CoTrackerLayout(OfficialLayout):
    """What both versions share: the renames of :data:`_COMMON_RULES` and the official ``time_emb`` table."""

    model: CoTracker

    def fixed_tensors(self) -> dict[str, Tensor]:
        """``time_emb``: [1, window_len, token_dim], computed on the CPU as the official model does."""
        return {"time_emb": self.model.time_table(torch.device("cpu"))[None]}


class CoTracker2Layout(CoTrackerLayout):
    """The official ``CoTracker2`` (``cotracker/models/core/cotracker/cotracker.py``).

    Example::

        >>> from lightning_memopt.models import create_model
        >>> layout = CoTracker2Layout(create_model("cotracker2_tiny"))
        >>> layout.official_names("fnet.stages.1.0.shortcut.0.weight", torch.zeros(1))
        ('fnet.layer2.0.downsample.0.weight',)
        >>> sorted((name, tuple(value.shape)) for name, value in layout.fixed_tensors().items())
        [('pos_emb', (1, 118, 16, 16)), ('time_emb', (1, 4, 118))]
    """

    family = "CoTracker2"
    rules = (
        *_COMMON_RULES,
        Rename(r"^updateformer\.output_head\.", "updateformer.flow_head."),
        Rename(r"^feature_norm\.", "norm."),
        Rename(r"^feature_update\.", "track_feat_updater."),
        Rename(r"^visibility_head\.", "vis_predictor.0."),
    )
    model: CoTracker2

    def fixed_tensors(self) -> dict[str, Tensor]:
        """``time_emb`` and ``pos_emb``: [1, token_dim, h, w], the sin-cos table of the integer feature grid."""
        height, width = (side // self.model.stride for side in self.model.model_resolution)
        ys, xs = torch.meshgrid(
            torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32), indexing="ij"
        )
        table = sincos_embedding_2d(torch.stack([xs, ys], dim=-1), self.model.token_dim)  # h w D
        return {**super().fixed_tensors(), "pos_emb": table.permute(2, 0, 1)[None].contiguous()}


class CoTracker3Layout(CoTrackerLayout):
    """The official ``CoTrackerThreeOnline`` and ``CoTrackerThreeOffline`` (one layout, the same parameters).

    Example::

        >>> from lightning_memopt.models import create_model
        >>> layout = CoTracker3Layout(create_model("cotracker3_tiny"))
        >>> layout.official_names("updateformer.output_head.weight", torch.zeros(4, 32))
        ('updateformer.flow_head.weight', 'updateformer.vis_conf_head.weight')
        >>> layout.official_names("correlation.mlp.0.weight", torch.zeros(1))
        ('corr_mlp.fc1.weight',)
    """

    family = "CoTracker3"
    rules = (*_COMMON_RULES, Rename(r"^correlation\.mlp\.", "corr_mlp."))
    _SPLIT_HEAD = "updateformer.output_head."

    def official_names(self, name: str, template: Tensor) -> tuple[str, ...]:
        """Our ``output_head`` is the official ``flow_head`` (Δx, Δy) over ``vis_conf_head``."""
        if name.startswith(self._SPLIT_HEAD):
            suffix = name[len(self._SPLIT_HEAD) :]
            return (f"updateformer.flow_head.{suffix}", f"updateformer.vis_conf_head.{suffix}")
        return super().official_names(name, template)

    def official_rows(self, name: str, template: Tensor) -> tuple[int, ...]:
        """Two rows each for the halves of ``output_head``."""
        if name.startswith(self._SPLIT_HEAD):
            return (2, template.shape[0] - 2)
        return super().official_rows(name, template)
