"""Registered CoTracker presets: the published CoTracker2 / CoTracker3 (online, offline) and tiny test variants."""

from __future__ import annotations

from typing import Any

from lightning_memopt.models.cotracker.cotracker import CoTracker2, CoTracker3, CoTracker3Offline
from lightning_memopt.models.registry import register_model

# Shared by the tiny variants: a tracker of about 150 k parameters on 64×64 clips that trains a step
# on CPU in a fraction of a second.
_TINY: dict[str, Any] = {
    "window_len": 4,
    "iters": 2,
    "corr_levels": 2,
    "corr_radius": 2,
    "model_resolution": (64, 64),
    "latent_dim": 32,
    "fnet_widths": (16, 16, 24, 24),
    "fnet_hidden_dim": 32,
    "hidden_dim": 32,
    "num_heads": 2,
    "time_depth": 1,
    "space_depth": 1,
    "num_virtual_tracks": 4,
}


@register_model("cotracker2")
def cotracker2(**overrides: Any) -> CoTracker2:
    """CoTracker2: window 8, full correlation (4 levels, radius 3), update transformer 6/6 at 384, 45.5 M parameters.

    Example::

        >>> import torch
        >>> with torch.device("meta"):
        ...     net = cotracker2(corr_radius=2)
        >>> net.token_dim
        360
    """
    return CoTracker2(**overrides)


@register_model("cotracker3")
def cotracker3(**overrides: Any) -> CoTracker3:
    """CoTracker3 (online): window 16, local 4-D correlation + MLP, update transformer 3/3 at 384, 25.4 M parameters.

    Example::

        >>> import torch
        >>> with torch.device("meta"):
        ...     net = cotracker3()
        >>> net.token_dim, net.window_len
        (1110, 16)
    """
    return CoTracker3(**overrides)


@register_model("cotracker3_offline")
def cotracker3_offline(**overrides: Any) -> CoTracker3Offline:
    """CoTracker3 (offline): the parameters of CoTracker3, the whole clip in one pass, a 60-frame time table.

    Example::

        >>> import torch
        >>> with torch.device("meta"):
        ...     net = cotracker3_offline()
        >>> net.window_len, sum(p.numel() for p in net.parameters())
        (60, 25385700)
    """
    return CoTracker3Offline(**overrides)


@register_model("cotracker2_tiny")
def cotracker2_tiny(**overrides: Any) -> CoTracker2:
    """A tiny CoTracker2 on 64×64 clips (window 4, 2 iterations, width 32, depth 1/1): for tests."""
    return CoTracker2(**{**_TINY, "flow_embed_dim": 16, **overrides})


@register_model("cotracker3_tiny")
def cotracker3_tiny(**overrides: Any) -> CoTracker3:
    """A tiny CoTracker3 on 64×64 clips (window 4, 2 iterations, width 32, depth 1/1): for tests."""
    return CoTracker3(**{**_TINY, "corr_hidden_dim": 32, "corr_embed_dim": 16, **overrides})


@register_model("cotracker3_offline_tiny")
def cotracker3_offline_tiny(**overrides: Any) -> CoTracker3Offline:
    """A tiny offline CoTracker3 on 64×64 clips (a 4-frame time table, 2 iterations, width 32): for tests."""
    return CoTracker3Offline(**{**_TINY, "corr_hidden_dim": 32, "corr_embed_dim": 16, **overrides})
