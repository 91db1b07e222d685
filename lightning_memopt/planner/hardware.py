"""The devices a plan is made for: a catalogue of GPUs, the live CUDA device, or a measured CPU
(:mod:`~lightning_memopt.planner.calibration`).

Figures are the vendors' dense peak rates (fp32 without TF32, TF32 on tensor cores where the board has
them, fp16/bf16 on tensor cores), memory bandwidth, host link (PCIe, each way) and peer link (NVLink
where the board has it), scaled by what a training step achieves of them (:data:`ACHIEVED`).
Memory is what ``nvidia-smi`` reports as the card's total. The host's memory bandwidth (what a
CPU-offloaded optimizer step streams through) is typical of the machines these boards sit in, not
of a board: about 50 GB/s for a desktop (two DDR4 / DDR5 channels), 100 GB/s for a server socket
(eight DDR4 channels, as sustained by a memory-bound loop), 150 GB/s for a DDR5 server. The
planner only compares candidates on one device, so the rates matter through their ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from lightning_memopt.arguments import check_float
from lightning_memopt.memory.workspace import BEFORE_HOPPER, HOPPER, LibraryWorkspace
from lightning_memopt.vocabulary import GIB, MIB


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about a device.

    Args:
        name: catalogue name (``"a800_80gb"``) or a description.
        memory_bytes: the device's total memory.
        bf16: whether bf16 matmuls run natively (Ampere and later).
        full_tflops / half_tflops: peak matmul rates in fp32 and in fp16/bf16, in TFLOP/s.
        memory_gbps: device memory bandwidth, GB/s.
        host_link_gbps: device ↔ host copies (activation offload), GB/s each way.
        peer_link_gbps: device ↔ device (FSDP gathers and reductions), GB/s each way.
        host_memory_gbps: the host's memory bandwidth, GB/s: the optimizer step under CPU offload
            runs at it (measured by :func:`~lightning_memopt.planner.calibration.measure_cpu`; the
            catalogue's are typical hosts).
        kernel_seconds: the host's time per kernel: Python, module calls, autograd and dispatch,
            and the launch (the host work of a step is the same beside a GPU as on a CPU).
        region_seconds: the host-side cost of checkpointing, by mode (``full``, ``selective``,
            ``offload``): seconds per checkpointed block call and per forward op inside it (views
            included: the recomputation's dispatch, saved-tensor hooks, selective's per-op mode), measured by
            :func:`~lightning_memopt.planner.host.measure_host`.
        tf32_tflops: TF32 rate on tensor cores, TFLOP/s (0: none). fp32 convolutions run at it while
            ``torch.backends.cudnn.allow_tf32`` (PyTorch's default), fp32 matmuls while
            ``torch.backends.cuda.matmul.allow_tf32`` (off by default).
        achieved: the share of the peak arithmetic rates and memory bandwidth a training step achieves
            (a measured CPU's rates are achieved ones: 1).
        host_overlaps: the host queues kernels while the device runs them, so a step takes the larger of
            the host's time and the device's (a GPU); off, the one processor does both in turn (a CPU).
        device_type: ``"cuda"`` or ``"cpu"``: the autocast op lists the planner's profiles follow (a bf16
            step keeps other tensors in fp32 on CUDA than on the CPU).
        workspace: the library workspaces (cuBLAS, cuDNN) its profiles count beside the tensors; ``None``
            for the CPU.
        host_is_device: the device is the host itself (this CPU, :func:`measure_cpu`): a copy to the host
            frees nothing, so neither activation offload nor CPU offload of the model states is planned.
        fused_attention_wins: fused attention (``sdpa``) is at least as fast as the materialised
            one (``math``) here, as on every GPU; the planner then leaves ``math`` out, since it
            also never needs less memory.
    """

    name: str
    memory_bytes: int
    bf16: bool
    full_tflops: float
    half_tflops: float
    memory_gbps: float
    host_link_gbps: float
    peer_link_gbps: float
    host_memory_gbps: float = 100.0
    kernel_seconds: float = 5e-6
    region_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    fused_attention_wins: bool = True
    tf32_tflops: float = 0.0
    achieved: float = 1.0
    host_overlaps: bool = True
    device_type: str = "cuda"
    workspace: LibraryWorkspace | None = BEFORE_HOPPER
    host_is_device: bool = False

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def mixed_precision(self) -> str:
        """The mixed precision this device runs best: bf16-mixed where it has bf16, else 16-mixed."""
        return "bf16-mixed" if self.bf16 else "16-mixed"


# Fitted on the first CUDA measurements (NVIDIA H200, the none and bf16-mixed step times of gpu_truth.py's
# cases, reproduce with `python benchmarks/calibration/cost_model_h200.py`): a step achieves 45 % of the peak rates,
# and its host spends 44 µs per kernel (Python, module calls, autograd, dispatch and the launch: the rows where bf16
# did not help).
ACHIEVED = 0.45
HOST_KERNEL_SECONDS = 44e-6
# What each mode of ours adds on the host, beyond queuing what it recomputes, as (seconds per wrapped block call,
# seconds per forward op inside it): Python work, the same beside a GPU as on the CPU that measured it (the narrow
# models of lightning_memopt.planner.host, wrapped block by block and four blocks a call; selective keeping its
# ops; `python benchmarks/claims/host_overhead.py`, 2026-11-28, 2 cores). Selective's since its blocks run as
# traced graphs (2026-11-29, a busier host: 1.08x full's per call and 1.12x full's per forward op, scaled onto
# full's entry).
HOST_REGION_SECONDS = {"full": (290e-6, 3.4e-6), "selective": (313e-6, 3.8e-6), "offload": (110e-6, 14.1e-6)}


def _gpu(
    name: str,
    mib: int,
    bf16: bool,
    full: float,
    tf32: float,
    half: float,
    hbm: float,
    host: float,
    peer: float,
    dram: float,
    workspace: LibraryWorkspace = BEFORE_HOPPER,
) -> Hardware:
    return Hardware(
        name,
        mib * MIB,
        bf16,
        full,
        half,
        hbm,
        host,
        peer,
        dram,
        kernel_seconds=HOST_KERNEL_SECONDS,
        region_seconds=dict(HOST_REGION_SECONDS),
        tf32_tflops=tf32,
        achieved=ACHIEVED,
        workspace=workspace,
    )


GPUS: dict[str, Hardware] = {
    gpu.name: gpu
    for gpu in (
        _gpu("v100_16gb", 16160, False, 15.7, 0.0, 125.0, 900.0, 12.0, 150.0, 100.0),
        _gpu("v100_32gb", 32510, False, 15.7, 0.0, 125.0, 900.0, 12.0, 150.0, 100.0),
        _gpu("t4_16gb", 15360, False, 8.1, 0.0, 65.0, 320.0, 12.0, 12.0, 100.0),
        _gpu("rtx3090_24gb", 24576, True, 35.6, 35.6, 71.0, 936.0, 25.0, 25.0, 50.0),
        _gpu("rtx4090_24gb", 24564, True, 82.6, 82.6, 165.2, 1008.0, 25.0, 25.0, 50.0),
        _gpu("l4_24gb", 23034, True, 30.3, 60.0, 121.0, 300.0, 25.0, 25.0, 100.0),
        _gpu("a100_40gb", 40960, True, 19.5, 156.0, 312.0, 1555.0, 25.0, 300.0, 100.0),
        _gpu("a100_80gb", 81920, True, 19.5, 156.0, 312.0, 2039.0, 25.0, 300.0, 100.0),
        _gpu("a800_80gb", 81920, True, 19.5, 156.0, 312.0, 2039.0, 25.0, 200.0, 100.0),
        _gpu("h100_80gb", 81559, True, 67.0, 494.0, 989.0, 3350.0, 50.0, 450.0, 150.0, HOPPER),
        _gpu("h200_141gb", 143771, True, 67.0, 494.0, 989.0, 4800.0, 50.0, 450.0, 150.0, HOPPER),
    )
}
# the catalogue's names, as a type (== tuple(GPUS), tests/test_public_signatures.py)
GpuName = Literal[
    "v100_16gb",
    "v100_32gb",
    "t4_16gb",
    "rtx3090_24gb",
    "rtx4090_24gb",
    "l4_24gb",
    "a100_40gb",
    "a100_80gb",
    "a800_80gb",
    "h100_80gb",
    "h200_141gb",
]
# substrings of torch.cuda.get_device_name() -> catalogue entries, by total memory where names repeat
_DEVICE_NAMES = (
    ("V100", ("v100_16gb", "v100_32gb")),
    ("T4", ("t4_16gb",)),
    ("3090", ("rtx3090_24gb",)),
    ("4090", ("rtx4090_24gb",)),
    ("L4", ("l4_24gb",)),
    ("A100", ("a100_40gb", "a100_80gb")),
    ("A800", ("a800_80gb",)),
    ("H100", ("h100_80gb",)),
    ("H200", ("h200_141gb",)),
)


def gpu(name: str) -> Hardware:
    """The catalogue entry ``name``.

    Raises:
        ValueError: for an unknown name, listing the catalogue.

    Example::

        >>> gpu("a800_80gb").memory_gib, gpu("v100_32gb").mixed_precision
        (80.0, '16-mixed')
    """
    if not isinstance(name, str) or name not in GPUS:
        raise ValueError(f"Unknown `gpu`={name!r}; valid names: {', '.join(GPUS)}")
    return GPUS[name]


def with_budget(hardware: Hardware, budget_gib: float) -> Hardware:
    """``hardware`` with its memory replaced by ``budget_gib`` GiB (e.g. what other processes leave free).

    Raises:
        TypeError: a ``hardware`` that is no :class:`Hardware`, or a budget that is no number (``"abc"``).
        ValueError: for a budget that is not positive.

    Example::

        >>> with_budget(gpu("t4_16gb"), 10).memory_gib
        10.0
        >>> with_budget(gpu("t4_16gb"), "abc")
        Traceback (most recent call last):
        ...
        TypeError: `budget` must be a number > 0, got 'abc' (str)
    """
    if not isinstance(hardware, Hardware):
        raise TypeError(
            f"`hardware` must be a Hardware (gpu(name), cuda_hardware(device), measure_cpu(bytes)), got "
            f"{hardware!r} ({type(hardware).__name__})"
        )
    budget = check_float("budget", budget_gib, minimum=0, open_minimum=True)
    return replace(hardware, memory_bytes=int(budget * GIB))


def cuda_hardware(device: torch.device) -> Hardware:
    """The catalogue entry of a live CUDA device (its own total memory), or a generic one for unknown boards."""
    properties = torch.cuda.get_device_properties(device)
    for marker, names in _DEVICE_NAMES:
        if marker in properties.name:
            closest = min(names, key=lambda name: abs(GPUS[name].memory_bytes - properties.total_memory))
            return replace(GPUS[closest], memory_bytes=properties.total_memory)
    generic = GPUS["a100_80gb"]
    return replace(
        generic,
        name=properties.name,
        memory_bytes=properties.total_memory,
        bf16=torch.cuda.is_bf16_supported(),
        workspace=HOPPER if properties.major >= 9 else BEFORE_HOPPER,  # PyTorch's cuBLAS workspace by architecture
    )
