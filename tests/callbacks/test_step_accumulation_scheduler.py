"""StepAccumulationScheduler on its own and inside AdaptiveAccumulation, and checkpoints of the former layout."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from lightning_memopt import AdaptiveAccumulation, StepAccumulationScheduler
from tests.callbacks.test_adaptive_accumulation import OOMToy, StepBatches, fit

# AdaptiveAccumulation's checkpoint entry as the code before the split wrote it (the sizer's keys first), after a
# recovery to micro-batches of 4 at step 0, evaluation in chunks of 3, and `accumulate_schedule={0: 1, 2: 2}` that
# had switched to 2 batches per step
FORMER_STATE = {
    "size": 4,
    "grow_after": 100,
    "grow_interval": 100,
    "oom_recoveries": 1,
    "preemptive_shrinks": 0,
    "last_change_step": 0,
    "grew_at": None,
    "largest_batch": 16,
    "eval_micro_batch_size": 3,
    "accumulate_schedule": "{0: 1, 2: 2}",
    "accumulate_grad_batches": 2,
    "learned_min_size": None,
    "learned_min_size_reason": None,
}


@pytest.mark.parametrize(
    ("schedule", "windows"),
    [
        ({0: 1, 2: 2}, [(0,), (1,), (2, 3), (0, 1), (2, 3)]),
        ({0: 2, 1: 4}, [(0, 1), (2, 3), (0, 1, 2, 3)]),  # batch 2 would start a window out of line
    ],
)
def test_on_its_own_it_changes_the_accumulation_at_aligned_steps(schedule, windows):
    recorder, module = StepBatches(), OOMToy()
    trainer = fit(module, [StepAccumulationScheduler(schedule), recorder], max_epochs=2, max_steps=-1)
    assert recorder.windows == windows and trainer.accumulate_grad_batches == schedule[max(schedule)]
    for counts, window in zip(module.counts, recorder.windows, strict=True):
        torch.testing.assert_close(counts.sum(), torch.tensor(16.0 * len(window)))  # every sample of the window once


def test_without_a_schedule_it_does_nothing():
    trainer = fit(OOMToy(), [StepAccumulationScheduler()], accumulate_grad_batches=2, max_steps=2)
    assert trainer.accumulate_grad_batches == 2


@pytest.mark.parametrize(
    ("callbacks", "options", "message"),
    [
        (lambda: [StepAccumulationScheduler({0: 2})], {"accumulate_grad_batches": 4}, "Trainer\\(accumulate_grad"),
        (lambda: [StepAccumulationScheduler({0: 2}), GradientAccumulationScheduler({0: 2})], {}, "GradientAccum"),
        (lambda: [AdaptiveAccumulation(accumulate_schedule={0: 2}), StepAccumulationScheduler({0: 4})], {}, "Step"),
    ],
)
def test_a_second_source_of_accumulation_is_refused(callbacks, options, message):
    with pytest.raises(MisconfigurationException, match=f"`.*`=.* and {message}.* both set the accumulation"):
        fit(OOMToy(), callbacks(), **options)


def test_manual_optimization_and_bad_schedules_are_refused():
    module = OOMToy()
    module.automatic_optimization = False
    with pytest.raises(MisconfigurationException, match="no gradients under `automatic_optimization=False`"):
        fit(module, [StepAccumulationScheduler({0: 2})])
    with pytest.raises(MisconfigurationException, match=r"^StepAccumulationScheduler: `scheduling`\[0\]=0 must be"):
        StepAccumulationScheduler({0: 0})


def _former_checkpoint(tmp_path):
    """A checkpoint at step 2 whose AdaptiveAccumulation entry is :data:`FORMER_STATE`, literally."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(OOMToy(), [AdaptiveAccumulation(), checkpoint], max_steps=2, enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=2.ckpt"
    saved = torch.load(path, weights_only=False)
    saved["callbacks"] = {"AdaptiveAccumulation": dict(FORMER_STATE)}
    torch.save(saved, path)
    return str(path)


class Resumed(pl.Callback):
    """What a resumed run starts with: the accumulation at train start, each batch's micro-batch size."""

    def __init__(self, adaptive):
        self.adaptive, self.accumulate, self.sizes = adaptive, None, []

    def on_train_start(self, trainer, pl_module):
        self.accumulate = trainer.accumulate_grad_batches

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sizes.append(self.adaptive.last_micro_batch_size)


@pytest.mark.parametrize("layout", ["convenience", "own callback"])
def test_a_checkpoint_of_the_former_layout_resumes(tmp_path, layout):
    path = _former_checkpoint(tmp_path)
    if layout == "convenience":
        adaptive = AdaptiveAccumulation(grow_after=100, accumulate_schedule={0: 1, 2: 2})
        callbacks = [adaptive]
    else:
        adaptive = AdaptiveAccumulation(grow_after=100)
        callbacks = [adaptive, StepAccumulationScheduler({0: 1, 2: 2})]
    resumed = Resumed(adaptive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(OOMToy(), [*callbacks, resumed], max_steps=4, ckpt_path=path)
    assert not [w for w in caught if "resuming with" in str(w.message)]
    assert resumed.accumulate == 2  # as the checkpoint's run had it, not the Trainer's 1
    assert resumed.sizes == [4, 4, 4, 4]  # two optimizer steps of two batches, in micro-batches of 4
    assert adaptive.eval_micro_batch_size == 3 and adaptive.sizer.oom_recoveries == 1
    assert adaptive.state_dict().keys() == FORMER_STATE.keys()  # and the layout is still the one written


def test_resuming_the_former_schedule_without_one_warns():
    adaptive = AdaptiveAccumulation()
    with pytest.warns(UserWarning, match="resuming with accumulate_schedule None; the checkpoint was written under"):
        adaptive.load_state_dict(dict(FORMER_STATE))
    assert adaptive.sizer.size == 4 and adaptive.eval_micro_batch_size == 3
