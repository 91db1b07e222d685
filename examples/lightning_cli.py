"""Train a face-recognition model with Lightning's ``LightningCLI``, lightning_memopt's callbacks and strategies.

Run it from the repository root::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.strategy=ddp_powersgd \\
        --trainer.devices=4
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml \\
        --trainer.callbacks+=lightning_memopt.TrainingSummary
    python examples/lightning_cli.py fit --help  # every argument, with the choices of each

The model is :class:`~lightning_memopt.tasks.FaceRecognitionModule`; the data any face datamodule, chosen by
class path (``--data=lightning_memopt.data.ImageFolderFaceDataModule --data.root=/data/faces
--data.num_classes=null``: ``null`` counts the identity folders), whose ``num_classes`` the model's
classifier takes. Callbacks and strategies are given by class path in the config or on the command
line; the registered strategy names (``ddp_memopt``, ``ddp_powersgd``, ``ddp_fp16_compress``,
``ddp_bf16_compress``, ``fsdp_memopt``) work because this script imports ``lightning_memopt``, which
registers them with Lightning (:mod:`lightning_memopt.registration`).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_memopt.data import FaceDataModule
from lightning_memopt.tasks import FaceRecognitionModule


class FaceRecognitionCLI(LightningCLI):
    """``LightningCLI`` whose model takes its number of classes from the datamodule."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # an image folder knows its identities only once scanned: link the built datamodule's attribute
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


def main(args: list[str] | None = None, run: bool = True) -> FaceRecognitionCLI:
    """Parse ``args`` (default: the command line), build the model, data and Trainer, and run the subcommand."""
    return FaceRecognitionCLI(
        FaceRecognitionModule,
        FaceDataModule,
        subclass_mode_data=True,  # any face datamodule, by class path
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
