"""The cost model: a step's time on a device, from the work counted on its fake run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.work import Work
from lightning_memopt.planner.estimate import copy_schedule
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.offload_price import BlockSeconds, OffloadedBlock, copy_waits, unhidden_seconds
from lightning_memopt.planner.sharding import UNSHARDED, ShardedTraffic
from lightning_memopt.vocabulary import GB, LEAN


@dataclass(frozen=True)
class StepCost:
    """Estimated seconds per optimizer step, by what they are spent on.

    On a GPU the host queues kernels while the device runs them and activation copies ride streams
    of their own: a step takes the largest of the device's work (plus what it waits for copies of
    activations its compute could not hide), the host link's and the host's (:attr:`total`). On a
    CPU (``overlapped`` false) one processor does all of it in turn.
    """

    compute: float  # matmul, convolution and attention arithmetic at the device's achieved rates
    memory: float  # every byte written once and read once, at the memory bandwidth
    launch: float  # the host's time per kernel (Python, autograd, dispatch, launch): small steps wait for it
    # the host link's busy time: offloaded activations each way (both at once on a GPU, out then back on a CPU);
    # CPU offload's shards and gradients
    offload: float
    communication: float  # FSDP: all-gather the units (twice with reshard after forward), reduce-scatter the gradients
    checkpointing: float = 0.0  # the host-side cost of the checkpointed regions (recomputation's dispatch, hooks)
    host: float = 0.0  # CPU offload: the optimizer step over the host's memory
    overlapped: bool = True
    offload_wait: float = 0.0  # the device waiting for offloaded activations: copy time its compute did not hide

    @property
    def device(self) -> float:
        """The device's own work: arithmetic, memory traffic and collectives."""
        return self.compute + self.memory + self.communication

    @property
    def host_work(self) -> float:
        """The host's work of queuing the step: its kernels and the checkpointed regions' bookkeeping."""
        return self.launch + self.checkpointing

    @property
    def bound(self) -> str:
        """What the step waits for: ``"device"``, ``"host link"`` or ``"host"``."""
        parts = {"device": self.device, "host link": max(self.offload, self.offload_wait), "host": self.host_work}
        return max(parts, key=parts.__getitem__)

    @property
    def total(self) -> float:
        if not self.overlapped:
            return self.device + self.offload + self.offload_wait + self.host_work + self.host
        return max(self.device + self.offload_wait, self.offload, self.host_work) + self.host


def step_cost(
    step_work: Work,
    optimizer_work: Work,
    hardware: Hardware,
    micro_batches: int = 1,
    offloaded_bytes: float = 0.0,
    traffic: ShardedTraffic = UNSHARDED,
    regions: Mapping[str, tuple[int, float]] | None = None,
    copies: Sequence[OffloadedBlock] = (),
) -> StepCost:
    """The time of one optimizer step: ``micro_batches`` forward/backward passes and one optimizer update.

    Args:
        step_work: the forward and backward work of one micro-batch (recomputation included).
        optimizer_work: the optimizer update's work, unsharded.
        hardware: the device.
        micro_batches: forward/backward passes per optimizer step.
        offloaded_bytes: activation bytes one micro-batch offloads to the host (copied back in backward).
        traffic: FSDP's bytes per micro-batch over the peer and host links, and this rank's share of
            the optimizer's work (:func:`~lightning_memopt.planner.sharding.sharded_traffic`). With
            CPU offload the optimizer step runs on the host: its bytes written, read and written
            once, at the host's memory bandwidth, and its kernels at the device's cost per kernel.
        regions: by checkpointing mode, the checkpointed block calls per micro-batch and the forward
            ops inside them (priced at ``hardware.region_seconds``).
        copies: the micro-batch's blocks in forward order with what each offloads
            (:func:`~lightning_memopt.planner.offload_price.offloaded_blocks`): the device waits for
            what the copy schedule cannot hide (:func:`~lightning_memopt.planner.offload_price.copy_waits`).
            Without them, on a GPU, for every byte out and back.

    Example::

        >>> from lightning_memopt.planner.hardware import gpu
        >>> work = Work(half_flops=312e12 * 0.45, kernels=10_000)   # one second of an A100's bf16, as achieved
        >>> cost = step_cost(work, Work(), gpu("a100_80gb"))
        >>> round(cost.compute, 6), round(cost.launch, 2), cost.bound   # the host queues 10,000 kernels meanwhile
        (1.0, 0.44, 'device')
        >>> on_host = ShardedTraffic(peer_bytes=0.0, host_bytes=25e9, optimizer_share=1.0, optimizer_on_host=True)
        >>> cost = step_cost(Work(), Work(bytes_written=50e9), gpu("a100_80gb"), traffic=on_host)
        >>> cost.offload, cost.host                 # 25 GB over PCIe at 25 GB/s; 50 GB read + written at 100 GB/s
        (1.0, 1.0)
    """
    optimizer_share = optimizer_work.scaled(traffic.optimizer_share)
    passes = step_work.scaled(micro_batches) + (Work() if traffic.optimizer_on_host else optimizer_share)
    compute = arithmetic_seconds(passes, hardware)
    memory = _memory_seconds(passes, hardware)
    launch = (passes.kernels + traffic.launches * micro_batches) * hardware.kernel_seconds
    link = hardware.host_link_gbps * GB
    activations = offloaded_bytes * micro_batches / link  # each way
    offload = traffic.host_bytes * micro_batches / link + activations * (1 if hardware.host_overlaps else 2)
    offload_wait = 0.0
    if hardware.host_overlaps:
        offload_wait = sum(copy_waits(block_seconds(copies, hardware))) * micro_batches if copies else 2 * activations
    communication = traffic.peer_bytes * micro_batches / (hardware.peer_link_gbps * GB)
    checkpointing = 0.0
    for mode, (calls, ops) in (regions or {}).items():
        # a lean recomputation's Python work: priced as full recomputation's (its pieces' kernels are counted apart)
        per_call, per_op = hardware.region_seconds.get("full" if mode == LEAN else mode, (0.0, 0.0))
        checkpointing += (calls * per_call + ops * per_op) * micro_batches
    host = 0.0
    if traffic.optimizer_on_host:
        host = 2 * optimizer_share.bytes_written / (hardware.host_memory_gbps * GB)
        host += optimizer_share.kernels * hardware.kernel_seconds
    return StepCost(
        compute, memory, launch, offload, communication, checkpointing, host, hardware.host_overlaps, offload_wait
    )


def block_seconds(copies: Sequence[OffloadedBlock], hardware: Hardware) -> list[BlockSeconds]:
    """``copies`` in seconds on ``hardware``, for the copy schedule (:mod:`~lightning_memopt.planner.offload_price`):
    a block's forward and backward take the longer of the device's work and the host's queuing of its kernels,
    its copies their bytes over the host link.

    Example::

        >>> from lightning_memopt.planner.hardware import gpu
        >>> second = Work(half_flops=989e12 * 0.45)   # a second of an H200's bf16 arithmetic, as achieved
        >>> block_seconds([OffloadedBlock(second, second.scaled(2), offloaded_bytes=25e9)], gpu("h200_141gb"))
        [BlockSeconds(forward=1.0, backward=2.0, copy=0.5)]
    """
    link = hardware.host_link_gbps * GB
    return [
        BlockSeconds(_busy_seconds(b.forward, hardware), _busy_seconds(b.backward, hardware), b.offloaded_bytes / link)
        for b in copies
    ]


def unhidden_offloads(anchor: MemoryProfile, blocks: Sequence[str], hardware: Hardware) -> dict[str, float]:
    """By block of ``blocks`` (tracked by ``anchor``, a profile without checkpointing): the seconds of its copies,
    offloaded with its output, that the block after it cannot hide on ``hardware``
    (:func:`~lightning_memopt.planner.offload_price.unhidden_seconds`; 0: hidden whichever others are offloaded).

    Example::

        >>> import torch
        >>> from lightning_memopt.memory import profile_step
        >>> from lightning_memopt.models import create_model
        >>> from lightning_memopt.planner.hardware import gpu
        >>> names = ("backbone.blocks.0", "backbone.blocks.1")
        >>> anchor = profile_step(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48), mode="fake",
        ...     loss_fn=lambda m, x: m(x).square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        ...     steps=1, blocks=names)
        >>> unhidden = unhidden_offloads(anchor, names, gpu("a100_80gb"))
        >>> unhidden[names[0]], unhidden[names[1]] > 0   # the last block's copies overlap nothing
        (0.0, True)
    """
    seconds = block_seconds(copy_schedule(anchor, dict.fromkeys(blocks, "offload")), hardware)
    unhidden = dict(zip(anchor.blocks, unhidden_seconds(seconds), strict=False))  # nothing offloaded: none listed
    return {name: unhidden.get(name, 0.0) for name in blocks}


def _busy_seconds(work: Work, hardware: Hardware) -> float:
    """The seconds ``work`` takes on a device whose host queues its kernels meanwhile."""
    device = arithmetic_seconds(work, hardware) + _memory_seconds(work, hardware)
    return max(device, work.kernels * hardware.kernel_seconds)


def _memory_seconds(work: Work, hardware: Hardware) -> float:
    """The seconds of ``work``'s memory traffic: every byte written once and read once, at the achieved bandwidth."""
    return 2 * work.bytes_written / (hardware.memory_gbps * GB * hardware.achieved)


def arithmetic_seconds(work: Work, hardware: Hardware) -> float:
    """The seconds of ``work``'s floating-point operations: half precision on tensor cores; fp32 convolutions in
    TF32 while cuDNN may use it (PyTorch's default), fp32 matmuls while matmuls may (off by default).

    Example::

        >>> from lightning_memopt.planner.hardware import gpu
        >>> h100 = gpu("h100_80gb")
        >>> conv = Work(full_flops=494e12, conv_flops=494e12)   # one second of an H100's TF32 peak
        >>> round(arithmetic_seconds(conv, h100) * h100.achieved, 3)
        1.0
    """
    tf32 = 0.0
    if hardware.tf32_tflops > 0:
        tf32 = work.conv_flops if torch.backends.cudnn.allow_tf32 else 0.0
        tf32 += work.full_flops - work.conv_flops if torch.backends.cuda.matmul.allow_tf32 else 0.0
    seconds = work.half_flops / (hardware.half_tflops * 1e12) + (work.full_flops - tf32) / (hardware.full_tflops * 1e12)
    if tf32:
        seconds += tf32 / (hardware.tf32_tflops * 1e12)
    return seconds / hardware.achieved
