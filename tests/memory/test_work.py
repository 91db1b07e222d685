import torch
from torch import nn

from lightning_memopt.memory import profile_step
from lightning_memopt.memory.work import Work, WorkCounter


def test_matmul_flops_are_exact_and_split_by_precision():
    counter = WorkCounter()
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with counter:
        a @ b
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a @ b
    total = counter.total()
    assert total.full_flops == 2 * 64 * 32 * 16
    assert total.half_flops == 2 * 64 * 32 * 16
    assert total.matmul_kernels == 2


def test_in_place_matmuls_count_as_their_out_of_place_twins():
    counter = WorkCounter()
    acc, a, b = torch.zeros(3, 64, 16), torch.randn(3, 64, 32), torch.randn(3, 32, 16)
    with counter:
        acc.baddbmm_(a, b)
        acc[0].addmm_(a[0], b[0])
    assert counter.total().full_flops == 2 * 64 * 32 * 16 * (3 + 1)
    assert counter.total().matmul_kernels == 2


def test_cpu_fused_attention_is_counted():
    q = torch.randn(2, 4, 16, 8)
    counter = WorkCounter()
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert counter.total().full_flops == 2 * 2 * 4 * 16 * 16 * (8 + 8)


def test_work_adds_and_the_cheap_part_leaves_the_matmuls_out():
    work = Work(1.0, 2.0, 100.0, 10.0, 60.0, 4.0) + Work(0.0, 2.0, 50.0, 5.0, 0.0, 0.0)
    assert work == Work(1.0, 4.0, 150.0, 15.0, 60.0, 4.0)
    assert work.without_matmuls() == Work(0.0, 0.0, 90.0, 11.0, 0.0, 0.0)


def _linear_profile(**options):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    return profile_step(
        model,
        torch.randn(32, 64),
        loss_fn=lambda m, x: m(x).square().mean(),
        optimizer=lambda p: torch.optim.AdamW(p),
        mode="fake",
        **options,
    )


def test_a_warm_optimizer_makes_one_profiled_step_the_steady_state():
    two_steps = _linear_profile(steps=2)
    one_warm = _linear_profile(steps=1, warm_optimizer=True)
    assert one_warm.peak_bytes == two_steps.peak_bytes
    assert one_warm.breakdown["optimizer_state"] == two_steps.breakdown["optimizer_state"] > 0


def test_work_and_phase_peaks_are_reported_per_step():
    profile = _linear_profile(steps=2)
    forward = profile.work(("forward",))
    assert forward.full_flops == 2 * (2 * 32 * 64 * 64)  # two linears, averaged over the two steps
    # weight gradients of both layers, the input gradient of the second only (the batch needs none)
    assert profile.work(("backward",)).full_flops == 3 * (2 * 32 * 64 * 64)
    assert max(profile.phase_peaks.values()) == profile.peak_bytes


def test_blocks_report_what_their_forward_leaves_for_backward():
    model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)))
    profile = profile_step(
        model,
        torch.randn(32, 64),
        loss_fn=lambda m, x: m(x).square().mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        mode="fake",
        steps=1,
        blocks=("1",),
    )
    account = profile.blocks["1"]
    # the hidden 32x256 after the first linear and after the GELU; the block's output is not counted
    assert account.saved_bytes == 2 * 32 * 256 * 4
    assert account.bytes_made_by(["addmm"]) == 32 * 256 * 4
    assert profile.work(("forward",), ("1",)).full_flops == 2 * (2 * 32 * 64 * 256)


def test_casts_between_float_dtypes_are_counted_apart():
    linear, inputs = torch.nn.Linear(16, 8), torch.randn(4, 16)
    with WorkCounter() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        linear(inputs)
    work = counter.total()  # autocast casts the weight, the bias and the input, then runs one matmul
    assert (work.cast_kernels, work.cast_bytes, work.kernels) == (3, (8 * 16 + 8 + 4 * 16) * 2, 4)
    with WorkCounter() as counter:
        linear(inputs).double()
        inputs.long()  # not between floats: no cast of a precision
    assert (counter.total().cast_kernels, counter.total().cast_bytes) == (1, 4 * 8 * 8)
