import functools
import math

import pytest
import torch

from lightning_memopt.models import CoTracker2, CoTracker3, CoTracker3Offline, create_model
from lightning_memopt.models.cotracker import BasicEncoder, UpdateFormer
from lightning_memopt.models.cotracker.correlation import FullCorrelation
from lightning_memopt.models.cotracker.embeddings import (
    flow_embedding,
    fourier_encoding,
    grid_sincos_embedding_2d,
    sincos_embedding,
    sincos_embedding_2d,
)
from lightning_memopt.models.cotracker.sampling import neighbourhood_offsets, sample_at_frames, sample_neighbourhoods
from lightning_memopt.models.cotracker.updateformer import attention
from lightning_memopt.models.structure import ATTENTION_IMPLS

# Parameter counts computed from the published layer shapes (PRESETS.md), in millions.
PUBLISHED_PARAMS_M = {"cotracker2": 45.5, "cotracker3": 25.4, "cotracker3_offline": 25.4}
EXACT_PARAMS = {"cotracker2": 45_458_787, "cotracker3": 25_385_700, "cotracker3_offline": 25_385_700}


@pytest.fixture(autouse=True)
def _one_thread(request):
    """The tiny trackers' kernels are so small that a second thread only adds overhead (5× under load)."""
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(1)


def _count(module):
    return sum(p.numel() for p in module.parameters())


def _on_meta(name, **overrides):
    with torch.device("meta"):
        return create_model(name, **overrides)


def _clip(batch=2, frames=7, tracks=6, size=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    video = torch.rand(batch, frames, 3, size, size, generator=generator) * 255
    query_frames = torch.arange(tracks).remainder(frames).float().view(1, tracks, 1).expand(batch, tracks, 1)
    positions = torch.rand(batch, tracks, 2, generator=generator) * (size - 1)
    return video, torch.cat([query_frames, positions], dim=-1)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_M))
def test_preset_parameter_count_is_within_3_percent_of_the_published_one(name):
    net = _on_meta(name)
    count_m = _count(net) / 1e6
    assert abs(count_m - PUBLISHED_PARAMS_M[name]) / PUBLISHED_PARAMS_M[name] < 0.03
    assert round(count_m, 1) == PUBLISHED_PARAMS_M[name]
    assert _count(net) == EXACT_PARAMS[name]  # the official models' counts
    assert {p.device.type for p in net.parameters()} == {"meta"}


def test_fnet_is_the_published_basic_encoder():
    fnet = BasicEncoder()
    assert _count(fnet) == 2_632_288  # "about 2.6 M"
    stem = fnet.stem[0]
    assert (stem.kernel_size, stem.stride, stem.out_channels) == ((7, 7), (2, 2), 64)
    assert [stage[0].conv1.out_channels for stage in fnet.stages] == [64, 96, 128, 128]
    assert [stage[0].conv1.stride for stage in fnet.stages] == [(1, 1), (2, 2), (2, 2), (2, 2)]
    assert (fnet.fuse[0].in_channels, fnet.fuse[0].out_channels, fnet.project.out_channels) == (416, 256, 128)
    small = BasicEncoder(widths=(8, 8, 8, 8), hidden_dim=8, output_dim=4)
    assert small(torch.randn(1, 3, 40, 24)).shape == (1, 4, 10, 6)  # stride 4


@pytest.mark.parametrize(("name", "depth", "window"), [("cotracker2", 6, 8), ("cotracker3", 3, 16)])
def test_updateformer_layout(name, depth, window):
    net = _on_meta(name)
    former = net.updateformer
    assert net.window_len == window
    assert len(former.time_blocks) == len(former.space_virtual_blocks) == depth
    assert len(former.space_virtual_from_point_blocks) == len(former.space_point_from_virtual_blocks) == depth
    assert former.virtual_tracks.shape == (1, 64, 1, 384)
    block = former.time_blocks[0]
    assert (block.attn.num_heads, block.attn.to_q.in_features, block.mlp[0].out_features) == (8, 384, 1536)
    assert net.fnet.output_dim == 128 and net.model_resolution == (384, 512)


@pytest.mark.parametrize(("radius", "token_dim"), [(3, 456), (2, 360)])
def test_cotracker2_token_width_follows_the_correlation_radius(radius, token_dim):
    net = _on_meta("cotracker2", corr_radius=radius)
    assert net.token_dim == net.updateformer.input_transform.in_features == token_dim
    assert net.correlation.output_dim == 4 * (2 * radius + 1) ** 2


def test_cotracker3_local_correlation_and_token_width():
    net = _on_meta("cotracker3")
    first, second = net.correlation.mlp[0], net.correlation.mlp[2]
    assert (first.in_features, first.out_features, second.out_features) == (2401, 384, 256)
    assert net.token_dim == net.updateformer.input_transform.in_features == 1 + 1 + 4 * 256 + 84
    assert net.updateformer.output_head.out_features == 4  # Δx, Δy, Δvisibility, Δconfidence


@pytest.mark.parametrize(
    ("name", "frames", "tracks"), [("cotracker2", 8, 768), ("cotracker3", 16, 384), ("cotracker3_offline", 24, 384)]
)
def test_published_presets_track_a_window_at_384_by_512_on_the_meta_device(name, frames, tracks):
    with torch.device("meta"):  # shapes only: nothing is computed or allocated
        net = create_model(name, iters=1)
        out = net(torch.empty(1, frames, 3, 384, 512), torch.empty(1, tracks, 3))
    assert out.tracks.shape == (1, frames, tracks, 2) and out.window_tracks.shape == (1, 1, 1, frames, tracks, 2)
    assert out.window_starts == (0,)


@pytest.mark.parametrize("name", ["cotracker2_tiny", "cotracker3_tiny"])
def test_forward_shapes_and_sliding_windows(name):
    net = create_model(name)  # window 4: windows start every 2 frames; 7 frames are padded to 8
    video, queries = _clip(batch=2, frames=7, tracks=6)
    out = net(video, queries)
    assert out.tracks.shape == (2, 7, 6, 2) and out.visibility.shape == (2, 7, 6)
    assert out.window_starts == (0, 2, 4) and out.num_frames == 7
    assert out.window_tracks.shape == (3, 2, 2, 4, 6, 2)  # windows, iterations, batch, window, tracks, xy
    assert out.window_frames().tolist() == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7]]
    # each frame comes from the last window that covers it
    torch.testing.assert_close(out.tracks[:, :2], out.window_tracks[0, -1, :, :2])
    torch.testing.assert_close(out.tracks[:, 2:4], out.window_tracks[1, -1, :, :2])
    torch.testing.assert_close(out.tracks[:, 4:], out.window_tracks[2, -1, :, :3])
    if name == "cotracker2_tiny":  # visibility once per window, no confidence
        assert out.window_visibility.shape == (3, 1, 2, 4, 6) and out.confidence is None
    else:
        assert out.window_visibility.shape == out.window_confidence.shape == (3, 2, 2, 4, 6)
        assert out.confidence.shape == (2, 7, 6)


def test_a_clip_shorter_than_the_window_is_one_padded_window():
    out = create_model("cotracker3_tiny")(*_clip(batch=1, frames=3, tracks=2))
    assert out.window_starts == (0,) and out.tracks.shape == (1, 3, 2, 2)


@pytest.mark.parametrize("name", ["cotracker2_tiny", "cotracker3_tiny", "cotracker3_offline_tiny"])
def test_without_updates_tracks_stay_at_the_queries_in_input_pixels(name):
    net = create_model(name)  # model resolution 64 × 64; the video is 40 × 48
    torch.nn.init.zeros_(net.updateformer.output_head.weight)
    torch.nn.init.zeros_(net.updateformer.output_head.bias)
    video = torch.rand(1, 6, 3, 40, 48) * 255
    queries = torch.tensor([[[0.0, 3.0, 5.0], [2.0, 47.0, 39.0], [5.0, 20.5, 10.25]]])
    out = net(video, queries)
    expected = queries[:, None, :, 1:].expand(1, 6, 3, 2)
    torch.testing.assert_close(out.tracks, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("name", "options"), [("cotracker2_tiny", {}), ("cotracker3_tiny", {"mask_unqueried": True})])
def test_a_track_not_yet_queried_cannot_influence_the_others(name, options):
    torch.manual_seed(0)
    net = create_model(name, **options)
    torch.nn.init.normal_(net.updateformer.output_head.weight, std=0.1)  # updates large enough to compare
    video, queries = _clip(batch=1, frames=8, tracks=4)
    queries[0, :, 0] = torch.tensor([0.0, 0.0, 1.0, 7.0])  # the last track is queried in the last window only
    moved = queries.clone()
    moved[0, 3, 1:] = torch.tensor([1.0, 62.0])
    first, second = net(video, queries), net(video, moved)
    # windows 0 and 1 (frames 0…5) end before frame 7: the other tracks come out the same
    torch.testing.assert_close(first.window_tracks[:2, :, :, :, :3], second.window_tracks[:2, :, :, :, :3])
    assert (first.window_tracks[2, :, :, :, :3] - second.window_tracks[2, :, :, :, :3]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["cotracker2_tiny", "cotracker3_tiny"])
def test_attention_implementations_agree(name):
    torch.manual_seed(0)
    fused = create_model(name, attn_impl="sdpa")
    materialised = create_model(name, attn_impl="math")
    materialised.load_state_dict(fused.state_dict())
    video, queries = _clip(batch=2, frames=7, tracks=6)
    a, b = fused(video, queries), materialised(video, queries)
    torch.testing.assert_close(a.window_tracks, b.window_tracks, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.window_visibility, b.window_visibility, atol=1e-5, rtol=1e-5)


def test_cotracker3_lets_not_yet_queried_tracks_take_part_as_the_official_model_does():
    torch.manual_seed(0)
    net = create_model("cotracker3_tiny")
    torch.nn.init.normal_(net.updateformer.output_head.weight, std=0.1)
    masks = []
    net.updateformer.register_forward_pre_hook(lambda module, args: masks.append(args[1]))
    video, queries = _clip(batch=1, frames=8, tracks=4)
    queries[0, :, 0] = torch.tensor([0.0, 0.0, 1.0, 7.0])  # the last track is queried in the last window only
    first, without_it = net(video, queries), net(video, queries[:, :3])
    assert masks and all(mask is None for mask in masks)  # the update transformer gets no mask
    # its (featureless) token still takes part in the space attention of the first window
    assert (first.window_tracks[0, :, :, :, :3] - without_it.window_tracks[0]).abs().max() > 1e-4


def test_attention_with_every_key_masked_is_the_mean_of_all_values():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    none_allowed = torch.zeros(1, 5, dtype=torch.bool)
    for impl in ATTENTION_IMPLS:
        torch.testing.assert_close(attention(q, k, v, none_allowed, impl), v.mean(dim=2, keepdim=True).expand_as(q))


def test_a_masked_query_attends_uniformly():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    query_mask = torch.tensor([[True, False, True]])
    for impl in ATTENTION_IMPLS:
        out = attention(q, k, v, None, impl, query_mask)
        torch.testing.assert_close(out[:, :, 1], v.mean(dim=2))  # the not-yet-queried point: the plain mean
        torch.testing.assert_close(out[:, :, [0, 2]], attention(q, k, v, None, impl)[:, :, [0, 2]])


def test_point_from_virtual_output_of_a_not_yet_queried_point_is_the_mean_of_the_virtual_values():
    torch.manual_seed(0)
    former = UpdateFormer(input_dim=6, output_dim=2, hidden_dim=8, num_heads=2, time_depth=1, space_depth=1)
    block = former.space_point_from_virtual_blocks[0]
    points, virtual = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    out = block(points, virtual, query_mask=torch.tensor([[True, False, True]]))
    values = block.attn.to_kv(block.norm_context(virtual)).chunk(2, dim=-1)[1]  # 5 × 8, heads side by side
    attended = points[:, 1] + block.attn.to_out(values.mean(dim=1))
    expected = attended + block.mlp(block.norm2(attended))
    torch.testing.assert_close(out[:, 1], expected)


def test_masked_keys_get_no_attention():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    mask = torch.tensor([[True, False, True, False]])
    changed = v.clone()
    changed[:, :, [1, 3]] = 100.0
    for impl in ATTENTION_IMPLS:
        torch.testing.assert_close(attention(q, k, v, mask, impl), attention(q, k, changed, mask, impl))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attn_impl": "flash"}, r"Unknown `attn_impl`='flash'; valid choices: sdpa, math"),
        ({"window_len": 5}, r"`window_len`=5 must be an even number"),
        ({"iters": 0}, r"`iters`=0 must be at least 1"),
        ({"model_resolution": (62, 64)}, r"`model_resolution`=\[62, 64\] must be \(height, width\), multiples"),
        ({"corr_levels": 0}, r"`corr_levels`=0 must be at least 1"),
        ({"corr_radius": -1}, r"`corr_radius`=-1 must be at least 0"),
        ({"padding_mode": "reflection"}, r"`padding_mode`='reflection' must be one of border, zeros"),
        ({"flow_embed_dim": 15}, r"`flow_embed_dim`=15 must be even"),
        ({"time_depth": 2, "space_depth": 3}, r"`space_depth`=3 must divide `time_depth`=2"),
    ],
)
def test_bad_arguments_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("cotracker2_tiny", **overrides)


def test_space_attention_runs_every_other_time_block_when_depths_differ():
    former = UpdateFormer(input_dim=6, output_dim=2, hidden_dim=8, num_heads=2, time_depth=4, space_depth=2)
    calls = []
    for block in former.space_virtual_blocks:
        block.register_forward_hook(lambda *args: calls.append(1))
    former(torch.randn(1, 3, 2, 6))
    assert former.space_every == 2 and len(calls) == 2


def test_bad_inputs_name_the_expected_shapes():
    net = create_model("cotracker2_tiny")
    with pytest.raises(ValueError, match=r"`video` must be \[B, T, 3, H, W\], got shape \(2, 3, 64, 64\)"):
        net(torch.zeros(2, 3, 64, 64), torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match=r"`queries` must be \[B, N, 3\]"):
        net(torch.zeros(1, 4, 3, 64, 64), torch.zeros(1, 2))


def test_presets_are_the_documented_classes():
    assert isinstance(create_model("cotracker2_tiny"), CoTracker2)
    assert isinstance(create_model("cotracker3_tiny"), CoTracker3)
    assert isinstance(create_model("cotracker3_offline_tiny"), CoTracker3Offline)
    assert create_model("cotracker3_tiny", window_len=6).window_len == 6


# ---- behaviour of the official implementation, checked from first principles ----


def test_samples_outside_the_map_read_the_border_or_zeros():
    maps = torch.arange(12.0).reshape(1, 1, 3, 4)  # value = 4·y + x
    outside = torch.tensor([[[-2.0, 1.0], [5.5, 2.0], [1.5, -3.0]]])
    border = sample_neighbourhoods(maps, outside, radius=0)[0, :, 0, 0]
    assert border.tolist() == [4.0, 11.0, 1.5]  # (0, 1), (3, 2), (1.5, 0)
    assert sample_neighbourhoods(maps, outside, radius=0, padding_mode="zeros").abs().max() == 0
    fmaps = maps[None].expand(1, 2, 1, 3, 4)
    assert sample_at_frames(fmaps, torch.tensor([[1]]), outside[:, :1]).flatten().tolist() == [4.0]


def test_neighbourhood_taps_are_x_outer():
    offsets = neighbourhood_offsets(2)
    for i in range(5):
        for j in range(5):
            assert offsets[i * 5 + j].tolist() == [i - 2, j - 2]
    volume_map = (torch.arange(8.0)[None, :] + 100 * torch.arange(8.0)[:, None])[None, None, None]  # x + 100·y
    correlation = FullCorrelation(levels=1, radius=1)
    taps = correlation([volume_map], torch.ones(1, 1, 1, 1), torch.tensor([[[[3.0, 4.0]]]]))
    assert taps.flatten().tolist() == pytest.approx([302, 402, 502, 303, 403, 503, 304, 404, 504], abs=1e-3)


def test_cotracker2_flow_embedding_is_the_official_formula():
    dx, dy = 0.015625, -0.25  # exact in float32, as are their products with the frequencies
    embedded = flow_embedding(torch.tensor([dx, dy]), 64)
    assert embedded.shape == (130,) and embedded[:2].tolist() == pytest.approx([dx, dy])
    for axis, value in enumerate([dx, dy]):
        for k in range(32):
            frequency = 2 * k * 1000 / 64
            start = 2 + 64 * axis + 2 * k
            assert embedded[start].item() == pytest.approx(math.sin(value * frequency), abs=1e-6)
            assert embedded[start + 1].item() == pytest.approx(math.cos(value * frequency), abs=1e-6)


def test_sincos_tables_are_computed_in_float64_and_rounded():
    frames, dim = torch.arange(16.0), 1110
    expected = torch.tensor(
        [
            [math.sin(t / 10000 ** (k / 555)) for k in range(555)]
            + [math.cos(t / 10000 ** (k / 555)) for k in range(555)]
            for t in range(16)
        ],
        dtype=torch.float64,
    ).float()
    assert torch.equal(sincos_embedding(frames, dim), expected)


def test_cotracker2_position_embedding_interpolates_the_integer_grid_table():
    dim, grid = 12, (4, 5)
    table = sincos_embedding_2d(torch.tensor([[x, y] for y in range(4) for x in range(5)], dtype=torch.float32), dim)
    table = table.view(4, 5, dim)  # [y, x]
    points = torch.tensor([[2.25, 1.5], [0.0, 3.0], [-1.0, 0.5], [7.0, 9.0]])
    by_hand = torch.stack(
        [
            0.75 * 0.5 * table[1, 2] + 0.25 * 0.5 * table[1, 3] + 0.75 * 0.5 * table[2, 2] + 0.25 * 0.5 * table[2, 3],
            table[3, 0],
            0.5 * table[0, 0] + 0.5 * table[1, 0],  # x clamped to the border
            table[3, 4],  # both clamped
        ]
    )
    torch.testing.assert_close(grid_sincos_embedding_2d(points, dim, grid), by_hand)


def test_cotracker3_motion_encoding_orders_degree_outer():
    a, b = 0.3, -0.7
    code = fourier_encoding(torch.tensor([a, b]), 0, 2)
    expected = [a, b, math.sin(a), math.sin(b), math.sin(2 * a), math.sin(2 * b)]
    expected += [math.cos(a), math.cos(b), math.cos(2 * a), math.cos(2 * b)]
    assert code.tolist() == pytest.approx(expected, abs=1e-6)


def test_cotracker3_features_are_divided_by_the_clamped_norm():
    net = create_model("cotracker3_tiny")
    fmaps = torch.zeros(1, 1, 32, 16, 16)
    fmaps[0, 0, 0, 3, 4] = 1e-7  # ‖f‖² = 1e-14 < 1e-12: divided by 1e-6, not by its norm
    fmaps[0, 0, :, 5, 5] = 2.0
    pyramid = net.track_context(fmaps, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 2)).pyramid
    assert pyramid[0][0, 0, 0, 3, 4].item() == pytest.approx(0.1)
    assert pyramid[0][0, 0, :, 5, 5].norm().item() == pytest.approx(1.0)


def test_offline_time_table_is_interpolated_linearly_to_the_clip():
    net = create_model("cotracker3_offline_tiny")  # a 4-row table
    table = net.time_table()
    assert torch.equal(net.time_embedding(4, table.device), table)
    six = net.time_embedding(6, table.device)
    for row in range(6):
        source = min(max((row + 0.5) * 4 / 6 - 0.5, 0.0), 3.0)  # align_corners=False
        low = int(source)
        high = min(low + 1, 3)
        torch.testing.assert_close(six[row], table[low] + (source - low) * (table[high] - table[low]))


def test_offline_tracks_the_whole_clip_in_one_unpadded_pass():
    torch.manual_seed(0)
    net = create_model("cotracker3_offline_tiny")
    frames_seen = []
    net.fnet.register_forward_hook(lambda module, args, output: frames_seen.append(args[0].shape[0]))
    video, queries = _clip(batch=2, frames=7, tracks=5)
    out = net(video, queries)
    assert frames_seen == [2 * 7]  # no padding frame
    assert out.window_starts == (0,) and out.window_tracks.shape == (1, 2, 2, 7, 5, 2)
    assert out.window_frames().tolist() == [list(range(7))]
    torch.testing.assert_close(out.tracks, out.window_tracks[0, -1])
    torch.testing.assert_close(out.confidence, out.window_confidence[0, -1])
