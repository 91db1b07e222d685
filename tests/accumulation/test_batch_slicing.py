from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

import lightning_memopt.batch_slicing as batch_slicing
from lightning_memopt.accumulation import BatchSplitError, batch_size, merge_outputs, register_batch_type, slice_batch

Pair = namedtuple("Pair", ["image", "label"])


@dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "synthetic"


def test_batch_size_of_nested_structures():
    batch = {"pair": Pair(torch.zeros(6, 3), torch.zeros(6)), "names": [f"n{i}" for i in range(6)], "k": 3}
    assert batch_size(batch) == 6
    assert batch_size(Sample(torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size([torch.zeros(4, 1), (torch.zeros(4),)]) == 4


def test_batch_size_errors_name_the_problem():
    with pytest.raises(BatchSplitError, match=r"batch\['b'\] \[3\] has 3"):
        batch_size({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(BatchSplitError, match="holds no tensor"):
        batch_size({"name": "x"})
    with pytest.raises(BatchSplitError, match="0-dimensional"):
        batch_size((torch.zeros(4), torch.tensor(1.0)))

    class Opaque:
        pass

    with pytest.raises(BatchSplitError, match=r"batch\[1\] of type Opaque.*register_batch_type\(Opaque"):
        batch_size((torch.zeros(2), Opaque()))


def test_slice_keeps_structure_and_shares_memory():
    images = torch.arange(24.0).view(6, 4)
    batch = OrderedDict(pair=Pair(images, torch.arange(6)), names=[f"n{i}" for i in range(6)], epoch=3)
    piece = slice_batch(batch, 2, 5)
    assert type(piece) is OrderedDict and type(piece["pair"]) is Pair
    assert torch.equal(piece["pair"].image, images[2:5]) and piece["pair"].image.data_ptr() == images[2:5].data_ptr()
    assert piece["pair"].label.tolist() == [2, 3, 4]
    assert piece["names"] == ["n2", "n3", "n4"] and piece["epoch"] == 3
    sample = slice_batch(Sample(images, torch.arange(6), "faces"), 0, 1)
    assert isinstance(sample, Sample) and sample.image.shape == (1, 4) and sample.source == "faces"


def test_slice_rejects_empty_or_out_of_range():
    with pytest.raises(ValueError, match="4:4"):
        slice_batch(torch.zeros(4), 4, 4)
    with pytest.raises(ValueError, match="2:9"):
        slice_batch(torch.zeros(4), 2, 9)


def test_custom_batch_type():
    class Clip:
        def __init__(self, frames):
            self.frames = frames

    class LongClip(Clip):
        pass

    register_batch_type(Clip, size=lambda clip: clip.frames.shape[1], slice=lambda c, a, b: type(c)(c.frames[:, a:b]))
    try:
        clip = LongClip(torch.arange(12.0).view(2, 6))
        assert batch_size({"clip": clip}) == 6
        assert slice_batch({"clip": clip}, 1, 3)["clip"].frames.tolist() == [[1.0, 2.0], [7.0, 8.0]]
    finally:
        batch_slicing._CUSTOM.pop(Clip)
    with pytest.raises(TypeError, match="must be a type"):
        register_batch_type("Clip", size=len, slice=lambda c, a, b: c)
    with pytest.raises(TypeError, match="`slice`=None must be a function"):
        register_batch_type(Clip, size=len, slice=None)


def test_merge_concatenates_and_weights():
    outputs = [
        {"pred": torch.ones(3, 2), "loss": torch.tensor(1.0), "acc": 0.5, "names": ["a", "b", "c"], "tag": "val"},
        {"pred": torch.zeros(1, 2), "loss": torch.tensor(5.0), "acc": 1.0, "names": ["d"], "tag": "val"},
    ]
    merged = merge_outputs(outputs, [3, 1])
    assert merged["pred"].shape == (4, 2) and merged["pred"][:3].eq(1).all()
    assert merged["loss"].item() == pytest.approx(2.0) and merged["acc"] == pytest.approx(0.625)
    assert merged["names"] == ["a", "b", "c", "d"] and merged["tag"] == "val"
    pairs = merge_outputs([Pair(torch.ones(2), None), Pair(torch.zeros(2), None)], [2, 2])
    assert isinstance(pairs, Pair) and pairs.image.tolist() == [1, 1, 0, 0] and pairs.label is None
    assert merge_outputs([None, None], [1, 1]) is None


def test_merge_of_one_output_returns_it_untouched():
    output = {"x": object()}
    assert merge_outputs([output], [4]) is output


def test_merge_errors():
    with pytest.raises(BatchSplitError, match="different types at output: NoneType, Tensor"):
        merge_outputs([torch.tensor(1.0), None], [1, 1])
    with pytest.raises(BatchSplitError, match=r"shapes \[\[5\], \[5\]\] neither follow the micro-batch sizes \[2, 2\]"):
        merge_outputs([torch.zeros(5), torch.zeros(5)], [2, 2])
    with pytest.raises(BatchSplitError, match="different keys"):
        merge_outputs([{"a": 1}, {"b": 1}], [1, 1])
    with pytest.raises(BatchSplitError, match="type object"):
        merge_outputs([object(), object()], [1, 1])
    with pytest.raises(ValueError, match="2 outputs for 1"):
        merge_outputs([1, 2], [1])
