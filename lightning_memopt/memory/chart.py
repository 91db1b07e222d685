"""One set-up for every chart the project draws: matplotlib off-screen, the figure laid out, saved and closed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def chart(path: str | Path, size: tuple[float, float], dpi: int = 100) -> Iterator[Any]:
    """Yield the axes of a new figure of ``size`` inches; on leaving, write it to ``path`` as a PNG.

    matplotlib is imported here only (an optional dependency): ``ImportError`` when it is missing.
    The figure is closed whether or not drawing succeeded.

    Example::

        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "line.png"
        >>> with chart(path, (4, 3)) as axes:
        ...     _ = axes.plot([0, 1], [0, 1])
        >>> path.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=size)
    try:
        yield axes
        figure.tight_layout()
        figure.savefig(path, dpi=dpi)
    finally:
        plt.close(figure)
