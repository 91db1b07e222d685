import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_memopt.memory import profile_step
from lightning_memopt.memory.autocast_lists import CudaAutocastLists
from lightning_memopt.private_api import FakeTensorMode

BF16, FP32 = torch.bfloat16, torch.float32


def _under_cuda_lists(fn):
    with torch.autocast("cpu", dtype=BF16), CudaAutocastLists(BF16):
        return fn()


def _under_cpu_autocast(fn):
    with torch.autocast("cpu", dtype=BF16):
        return fn()


x16 = torch.randn(2, 4, 6, 6).to(BF16)
x32 = torch.randn(4, 8)
CASES = {
    # name: (call, dtype under CUDA's lists, dtype under CPU autocast)
    "layer_norm": (lambda: F.layer_norm(x16, (6,)), FP32, BF16),
    "group_norm": (lambda: F.group_norm(x16, 2), FP32, BF16),
    "softmax functional": (lambda: F.softmax(x16, -1), FP32, BF16),
    "softmax method": (lambda: x16.softmax(-1), FP32, BF16),
    "log_softmax": (lambda: torch.log_softmax(x16, -1), FP32, BF16),
    "sum": (lambda: x16.sum(), FP32, BF16),
    "exp": (lambda: torch.exp(x16), FP32, BF16),
    "power operator": (lambda: x16**2, FP32, BF16),
    "normalize": (lambda: F.normalize(x16, dim=1), FP32, BF16),  # CUDA's norm in fp32: the division promotes
    "linear": (lambda: F.linear(x32, torch.randn(8, 8)), BF16, BF16),
    "einsum": (lambda: torch.einsum("ij,jk->ik", x32, torch.randn(8, 8)), BF16, BF16),
    "mv": (lambda: torch.mv(x32, torch.randn(8)), BF16, FP32),
    "grid_sample": (lambda: F.grid_sample(x16, torch.zeros(2, 3, 3, 2, dtype=BF16), align_corners=False), BF16, FP32),
    "relu (no list)": (lambda: F.relu(x16), BF16, BF16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ops_take_the_dtype_cuda_autocast_gives_them(name):
    call, on_cuda, on_cpu = CASES[name]
    assert _under_cuda_lists(call).dtype == on_cuda
    assert _under_cpu_autocast(call).dtype == on_cpu


def test_ops_only_the_cpu_runs_in_fp32_keep_their_dtype_in_a_prediction():
    real = x16.unsqueeze(0)
    with FakeTensorMode() as fake:
        x = fake.from_tensor(real)
        assert _under_cuda_lists(lambda: F.avg_pool3d(x, 2)).dtype == BF16
        assert _under_cpu_autocast(lambda: F.avg_pool3d(x, 2)).dtype == FP32
    # a real CPU step keeps the CPU's fp32 there (it has no bf16 kernel for avg_pool3d)
    assert _under_cuda_lists(lambda: F.avg_pool3d(x16.unsqueeze(0), 2)).dtype == FP32


def test_outside_autocast_nothing_is_cast():
    with CudaAutocastLists(BF16):
        assert F.layer_norm(x16, (6,)).dtype == BF16


def test_a_given_dtype_is_kept():
    assert _under_cuda_lists(lambda: x16.sum(dtype=BF16)).dtype == BF16
    assert _under_cuda_lists(lambda: torch.softmax(x16, -1, BF16)).dtype == BF16  # given positionally
    out = torch.empty(4, 6, 6, dtype=BF16)
    assert _under_cuda_lists(lambda: torch.sum(x16, 0, out=out)) is out  # an out= form is not autocast


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        hidden = self.fc(self.norm(x))
        return x + torch.softmax(hidden @ hidden.transpose(-1, -2), -1) @ hidden


def _profile(mode, device_type, prepare=None):
    torch.manual_seed(0)
    return profile_step(
        lambda: nn.Sequential(_Block(), _Block()),
        torch.randn(4, 64, 32),
        loss_fn=lambda model, x: model(x).float().pow(2).mean(),
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        mode=mode,
        precision="bf16-mixed",
        device_type=device_type,
        prepare_model=prepare,
    )


def test_a_profile_for_cuda_keeps_the_fp32_tensors_cuda_would():
    cpu, cuda = _profile("fake", "cpu"), _profile("fake", "cuda")
    assert cuda.peak_bytes > cpu.peak_bytes
    # the fake prediction and a real step run on the CPU under the same lists agree byte for byte
    assert _profile("real", "cuda").peak_bytes == cuda.peak_bytes


def test_recomputation_in_backward_follows_the_same_lists():
    from lightning_memopt.checkpointing import apply_activation_checkpointing

    def checkpoint(model):
        apply_activation_checkpointing(model, {"modules": [_Block]})

    fake, real = _profile("fake", "cuda", checkpoint), _profile("real", "cuda", checkpoint)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_bytes > _profile("fake", "cpu", checkpoint).peak_bytes


def test_an_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match=r"Unknown `device_type`='tpu'; valid choices: cpu, cuda, None"):
        profile_step(nn.Linear(2, 2), torch.randn(1, 2), loss_fn=lambda m, x: m(x).sum(), device_type="tpu")
