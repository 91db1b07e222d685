"""The cost model: a step's time on a device, from the work counted on its fake run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_memopt.memory.work import Work
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.sharding import UNSHARDED, ShardedTraffic
from lightning_memopt.vocabulary import GB, LEAN


@dataclass(frozen=True)
class StepCost:
    """Estimated seconds per optimizer step, by what they are spent on.

    On a GPU the host queues kernels while the device runs them and activation copies ride a side
    stream: a step takes the largest of the device's work, the host link's and the host's
    (:attr:`total`). On a CPU (``overlapped`` false) one processor does all of it in turn.
    """

    compute: float  # matmul, convolution and attention arithmetic at the device's achieved rates
    memory: float  # every byte written once and read once, at the memory bandwidth
    launch: float  # the host's time per kernel (Python, autograd, dispatch, launch): small steps wait for it
    offload: float  # the host link: offloaded activations to the host and back; CPU offload's shards and gradients
    communication: float  # FSDP: all-gather the units (twice with reshard after forward), reduce-scatter the gradients
    checkpointing: float = 0.0  # the host-side cost of the checkpointed regions (recomputation's dispatch, hooks)
    host: float = 0.0  # CPU offload: the optimizer step over the host's memory
    overlapped: bool = True

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
        parts = {"device": self.device, "host link": self.offload, "host": self.host_work}
        return max(parts, key=parts.__getitem__)

    @property
    def total(self) -> float:
        if not self.overlapped:
            return self.device + self.offload + self.host_work + self.host
        return max(self.device, self.offload, self.host_work) + self.host


def step_cost(
    step_work: Work,
    optimizer_work: Work,
    hardware: Hardware,
    micro_batches: int = 1,
    offloaded_bytes: float = 0.0,
    traffic: ShardedTraffic = UNSHARDED,
    regions: Mapping[str, tuple[int, float]] | None = None,
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
    memory = 2 * passes.bytes_written / (hardware.memory_gbps * GB * hardware.achieved)
    launch = (passes.kernels + traffic.launches * micro_batches) * hardware.kernel_seconds
    host_link = 2 * offloaded_bytes + traffic.host_bytes
    offload = host_link * micro_batches / (hardware.host_link_gbps * GB)
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
    return StepCost(compute, memory, launch, offload, communication, checkpointing, host, hardware.host_overlaps)


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
