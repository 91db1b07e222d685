"""The cost model: a step's time on a device, from the work counted on its fake run."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memopt.memory.work import Work
from lightning_memopt.planner.hardware import Hardware


@dataclass(frozen=True)
class StepCost:
    """Estimated seconds per optimizer step, by what they are spent on."""

    compute: float  # matmul, convolution and attention arithmetic at the device's peak rates
    memory: float  # every byte written once and read once, at the memory bandwidth
    launch: float  # a fixed cost per kernel: what makes small micro-batches inefficient
    offload: float  # offloaded activations to the host and back
    communication: float  # FSDP: gather the parameters twice, reduce-scatter the gradients
    checkpointing: float = 0.0  # the host-side cost of the checkpointed regions (hooks, bookkeeping)

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.launch + self.offload + self.communication + self.checkpointing


def step_cost(
    step_work: Work,
    optimizer_work: Work,
    hardware: Hardware,
    micro_batches: int = 1,
    offloaded_bytes: float = 0.0,
    shards: int = 1,
    parameter_bytes: float = 0.0,
    checkpoint_mode: str = "none",
    regions: int = 0,
    region_kernels: float = 0.0,
) -> StepCost:
    """The time of one optimizer step: ``micro_batches`` forward/backward passes and one optimizer update.

    Args:
        step_work: the forward and backward work of one micro-batch (recomputation included).
        optimizer_work: the optimizer update's work.
        hardware: the device.
        micro_batches: forward/backward passes per optimizer step.
        offloaded_bytes: activation bytes one micro-batch offloads to the host (copied back in backward).
        shards: FSDP shards (1: none).
        parameter_bytes: the parameters' bytes in the compute precision (what FSDP gathers).
        checkpoint_mode / regions / region_kernels: the checkpointing mode, its checkpointed block
            calls per micro-batch and the forward kernels inside them.

    Example::

        >>> from lightning_memopt.planner.hardware import gpu
        >>> work = Work(half_flops=312e12)          # one second of an A100's bf16 peak
        >>> round(step_cost(work, Work(), gpu("a100_80gb")).compute, 6)
        1.0
    """
    passes = step_work.scaled(micro_batches) + optimizer_work
    compute = passes.half_flops / (hardware.half_tflops * 1e12) + passes.full_flops / (hardware.full_tflops * 1e12)
    memory = 2 * passes.bytes_written / (hardware.memory_gbps * 1e9)
    launch = passes.kernels * hardware.kernel_seconds
    offload = 2 * offloaded_bytes * micro_batches / (hardware.host_link_gbps * 1e9)
    gathered = 3 * parameter_bytes * (shards - 1) / shards * micro_batches
    communication = gathered / (hardware.peer_link_gbps * 1e9)
    per_call, per_kernel = hardware.region_seconds.get(checkpoint_mode, (0.0, 0.0))
    checkpointing = (regions * per_call + region_kernels * per_kernel) * micro_batches
    return StepCost(compute, memory, launch, offload, communication, checkpointing)
