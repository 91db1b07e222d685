"""``python -m lightning_memopt.train``: the same as ``memopt-train``."""

from lightning_memopt.cli.train import main

if __name__ == "__main__":
    main()
