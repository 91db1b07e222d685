"""SyntheticFaceDataModule, and through it the FaceDataModule base (loaders, validation, hparams)."""

import time
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_memopt.data import FaceAugmentation, SyntheticFaceDataModule
from lightning_memopt.data.synthetic_face import SyntheticFaceDataset
from tests.helpers import quiet_trainer

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def small(**kwargs) -> SyntheticFaceDataModule:
    args = {"num_classes": 5, "samples_per_class": 4, "val_samples_per_class": 2, "image_size": 16}
    return SyntheticFaceDataModule(**{**args, "batch_size": 4, **kwargs})


def test_same_index_gives_identical_tensor():
    first, second = small(), small()
    first.setup()
    second.setup()
    for index in (0, 7, 19):
        image, label = first.train_dataset[index]
        torch.testing.assert_close(image, second.train_dataset[index][0], rtol=0, atol=0)
        assert label == second.train_dataset[index][1] == index // 4


def test_sample_depends_only_on_seed_class_and_sample_number():
    reference = SyntheticFaceDataset(num_classes=3, samples_per_class=6, image_size=16, seed=1)
    larger = SyntheticFaceDataset(num_classes=9, samples_per_class=6, image_size=16, seed=1)
    shifted = SyntheticFaceDataset(num_classes=3, samples_per_class=2, image_size=16, seed=1, first_sample=4)
    assert torch.equal(reference[2 * 6 + 1][0], larger[2 * 6 + 1][0])
    assert torch.equal(reference[1 * 6 + 5][0], shifted[1 * 2 + 1][0])


def test_different_seeds_give_different_images():
    a = SyntheticFaceDataset(num_classes=2, samples_per_class=2, image_size=16, seed=0)
    b = SyntheticFaceDataset(num_classes=2, samples_per_class=2, image_size=16, seed=1)
    assert not torch.allclose(a[0][0], b[0][0])


def test_batches_have_face_format():
    dm = small()
    dm.setup()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        images, labels = next(iter(loader))
        assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
        assert labels.shape == (4,) and labels.dtype == torch.int64
        assert images.min() >= -1 and images.max() <= 1
        assert labels.min() >= 0 and labels.max() < dm.num_classes


def test_every_class_appears_equally_often_in_an_epoch():
    dm = small(num_classes=4, samples_per_class=3, batch_size=4)
    labels = torch.cat([batch[1] for batch in dm.train_dataloader()])
    assert torch.bincount(labels, minlength=4).tolist() == [3, 3, 3, 3]
    val_labels = torch.cat([batch[1] for batch in dm.val_dataloader()])
    assert val_labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # in order, no shuffle


def test_train_and_val_samples_differ():
    dm = small()
    train = torch.stack([dm.train_dataset[i][0] for i in range(len(dm.train_dataset))]).flatten(1)
    val = torch.stack([dm.val_dataset[i][0] for i in range(len(dm.val_dataset))]).flatten(1)
    assert torch.cdist(val, train).min() > 1.0


def test_classes_are_learnable_by_nearest_class_mean():
    dm = small(num_classes=10, samples_per_class=8, val_samples_per_class=4)
    train = [dm.train_dataset[i] for i in range(len(dm.train_dataset))]
    means = torch.stack([torch.stack([x for x, y in train if y == c]).mean(0) for c in range(10)]).flatten(1)
    val_images = torch.stack([dm.val_dataset[i][0] for i in range(len(dm.val_dataset))]).flatten(1)
    val_labels = torch.tensor([dm.val_dataset[i][1] for i in range(len(dm.val_dataset))])
    predicted = torch.cdist(val_images, means).argmin(1)
    assert torch.equal(predicted, val_labels)


def test_numpy_and_python_indices_give_the_same_sample():
    dataset = SyntheticFaceDataset(num_classes=3, samples_per_class=2, image_size=16, seed=0)
    image, label = dataset[np.int64(3)]
    assert torch.equal(image, dataset[3][0]) and label == 1 and type(label) is int


def test_generation_is_cheap():
    dataset = SyntheticFaceDataset(num_classes=100, samples_per_class=16, image_size=112, seed=0)
    dataset[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in DataLoader workers; avoids noise from other processes' threads
    try:
        timings = []
        for _ in range(3):  # best of three: other processes may share the CPU
            start = time.perf_counter()
            torch.stack([dataset[i][0] for i in range(16)])
            timings.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert min(timings) < 0.1


def test_no_validation_samples_gives_empty_val_dataloader():
    dm = small(val_samples_per_class=0)
    assert dm.val_dataset is None
    assert dm.val_dataloader() == []


def test_setup_is_idempotent():
    dm = small()
    dm.setup("fit")
    train, val = dm.train_dataset, dm.val_dataset
    dm.setup("validate")
    assert dm.train_dataset is train and dm.val_dataset is val


def test_augmentation_applies_to_train_only():
    dm = small(augmentation={"hflip": 1.0})
    assert dm.augmentation == FaceAugmentation(hflip=1.0)
    raw = SyntheticFaceDataset(num_classes=5, samples_per_class=4, image_size=16, seed=0)
    assert torch.equal(dm.train_dataset[3][0], raw[3][0].flip(-1))
    val_raw = SyntheticFaceDataset(num_classes=5, samples_per_class=2, image_size=16, seed=0, first_sample=4)
    assert torch.equal(dm.val_dataset[3][0], val_raw[3][0])


def test_identity_augmentation_is_not_wrapped():
    dm = small(augmentation=FaceAugmentation(hflip=0.0))
    assert isinstance(dm.train_dataset, SyntheticFaceDataset)


@pytest.mark.parametrize("augmentation", [FaceAugmentation(hflip=0.3), {"hflip": 0.3}, None])
def test_hyperparameters_rebuild_the_datamodule(augmentation):
    dm = small(augmentation=augmentation, seed=3)
    expected = None if augmentation is None else {"hflip": 0.3, "rotation_degrees": 0.0, "color_jitter": 0.0}
    assert dm.hparams["augmentation"] == expected
    assert dm.hparams_initial["augmentation"] == expected
    assert dm.hparams["num_classes"] == 5 and dm.hparams["seed"] == 3 and dm.hparams["batch_size"] == 4
    rebuilt = SyntheticFaceDataModule(**dm.hparams)
    assert rebuilt.augmentation == dm.augmentation
    assert torch.equal(rebuilt.val_dataset[5][0], dm.val_dataset[5][0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_classes": 0}, ValueError, r"`num_classes` must be an integer ≥ 1, got 0"),
        ({"num_classes": "ten"}, TypeError, r"`num_classes` must be an integer ≥ 1, got 'ten' \(str\)"),
        ({"samples_per_class": 0}, ValueError, r"`samples_per_class` must be an integer ≥ 1, got 0"),
        ({"samples_per_class": 2.5}, TypeError, r"`samples_per_class` must be an integer ≥ 1, got 2.5 \(float\)"),
        ({"val_samples_per_class": -1}, ValueError, r"`val_samples_per_class` must be an integer ≥ 0, got -1"),
        ({"image_size": 8}, ValueError, r"`image_size` must be an integer ≥ 16, got 8"),
        ({"image_size": 100}, ValueError, r"`image_size` must be a multiple of 16.*got 100"),
        ({"image_size": None}, TypeError, r"`image_size` must be an integer ≥ 16, got None"),
        ({"seed": "zero"}, TypeError, r"`seed` must be an integer, got 'zero' \(str\)"),
        ({"verification_pairs": "maybe"}, ValueError, r"`verification_pairs` must be true or false, got 'maybe'"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an integer ≥ 1, got 0"),
        # Hydra passes `data.batch_size=abc` as the string "abc"
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"batch_size": True}, TypeError, r"`batch_size` must be an integer ≥ 1, got True \(bool\)"),
        ({"val_batch_size": 0}, ValueError, r"`val_batch_size` must be an integer ≥ 1, got 0"),
        ({"val_batch_size": "8"}, TypeError, r"`val_batch_size` must be an integer ≥ 1, got '8' \(str\)"),
        ({"num_workers": -1}, ValueError, r"`num_workers` must be an integer ≥ 0, got -1"),
        ({"pin_memory": "sometimes"}, ValueError, r"`pin_memory` must be true or false, got 'sometimes' \(str\)"),
        ({"pin_memory": 2}, ValueError, r"`pin_memory` must be true or false, got 2 \(int\)"),
        ({"drop_last": None}, ValueError, r"`drop_last` must be true or false, got None"),
        ({"persistent_workers": True}, ValueError, r"`persistent_workers=True` needs worker processes"),
        ({"persistent_workers": "on"}, ValueError, r"`persistent_workers=True` needs worker processes"),
        ({"augmentation": {"flip": 0.5}}, ValueError, r"`augmentation` got unknown keys \['flip'\].*'hflip'"),
        ({"augmentation": 0.5}, TypeError, r"`augmentation` must be a FaceAugmentation.*got 0.5"),
        ({"augmentation": {"hflip": 2.0}}, ValueError, r"`hflip`.*got 2.0"),
        ({"augmentation": {"hflip": "yes"}}, TypeError, r"`hflip`.*got 'yes' \(str\)"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        small(**kwargs)


def test_booleans_are_read_as_words_never_by_truthiness():
    dm = small(pin_memory="off", drop_last="false", verification_pairs="no")
    assert dm.pin_memory is False and dm.loader_options["pin_memory"] is False
    assert dm.drop_last is False and dm.verification_pairs is False
    dm = small(pin_memory="yes", drop_last=1)
    assert dm.pin_memory is True and dm.drop_last is True


def test_checked_values_are_saved_as_hyperparameters():
    dm = small(num_classes=5.0, seed=3.0)
    assert dm.num_classes == 5 and type(dm.hparams["num_classes"]) is int and type(dm.hparams["seed"]) is int


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_classes": 0}, ValueError, r"`num_classes` must be an integer ≥ 1, got 0"),
        ({"samples_per_class": "4"}, TypeError, r"`samples_per_class` must be an integer ≥ 1, got '4' \(str\)"),
        ({"image_size": 0}, ValueError, r"`image_size` must be an integer ≥ 1, got 0"),
        ({"seed": 0.5}, TypeError, r"`seed` must be an integer, got 0.5 \(float\)"),
        ({"first_sample": -1}, ValueError, r"`first_sample` must be an integer ≥ 0, got -1"),
    ],
)
def test_bad_dataset_arguments_raise(kwargs, error, match):
    args = {"num_classes": 2, "samples_per_class": 2, "image_size": 16, "seed": 0}
    with pytest.raises(error, match=match):
        SyntheticFaceDataset(**{**args, **kwargs})


def test_training_set_smaller_than_a_batch_raises_with_drop_last():
    dm = small(num_classes=2, samples_per_class=1, batch_size=4)
    with pytest.raises(ValueError, match=r"training set has 2 samples, fewer than `batch_size`=4"):
        dm.train_dataloader()
    keep_last = small(num_classes=2, samples_per_class=1, batch_size=4, drop_last=False)
    assert len(keep_last.train_dataloader()) == 1


class _Classifier(L.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3 * 16 * 16, num_classes)
        self.val_batches = 0

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.head(images.flatten(1)), labels)

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("val_samples_per_class", [0, 1])
def test_trainer_fit(val_samples_per_class):
    dm = small(val_samples_per_class=val_samples_per_class, augmentation={"hflip": 0.5})
    model = _Classifier(dm.num_classes)
    trainer = quiet_trainer(max_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Total length of `list` across ranks is zero.*")
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    assert model.val_batches == (0 if val_samples_per_class == 0 else 2)  # sanity check: 2 batches


def test_checkpoint_restores_the_datamodule(tmp_path):
    dm = small(augmentation=FaceAugmentation(rotation_degrees=5.0), seed=2)
    trainer = quiet_trainer(max_steps=1, num_sanity_val_steps=0)
    trainer.fit(_Classifier(dm.num_classes), datamodule=dm)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    restored = SyntheticFaceDataModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert restored.augmentation == dm.augmentation
    assert (restored.num_classes, restored.seed, restored.image_size) == (5, 2, 16)


def test_config_instantiates():
    cfg = OmegaConf.create({"seed": 5, "data": OmegaConf.load(CONF_DIR / "data" / "synthetic_face.yaml")})
    cfg.data.num_classes = 3
    cfg.data.image_size = 16
    dm = instantiate(cfg.data)
    assert isinstance(dm, SyntheticFaceDataModule)
    assert (dm.num_classes, dm.seed, dm.batch_size) == (3, 5, 16)
    assert dm.augmentation == FaceAugmentation(hflip=0.5)


def test_config_composes_with_hydra():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(overrides=["+data=synthetic_face", "+seed=0", "data.image_size=32"])
    dm = instantiate(cfg.data)
    assert (dm.num_classes, dm.image_size, dm.seed) == (100, 32, 0)
