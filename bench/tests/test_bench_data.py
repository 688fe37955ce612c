"""The images benchmark's data: photo ImageFolder builder, scanning, raw .npy, pipeline."""
from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from mploader_bench import data, pipeline  # noqa: E402
from mploader_bench.images import batch_checksum, consume, make_batches  # noqa: E402


def _sources(n: int = 3, seed: int = 0) -> list[np.ndarray]:
    """Small smooth RGB 'photos' (gradients plus noise), (H, W, 3) uint8."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = 60 + 10 * i, 80 - 5 * i
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], axis=-1)
        img = img + rng.integers(0, 30, img.shape)
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def _write_folder(root, classes: dict[str, int], size=(40, 30), fmt="JPEG", mode="RGB") -> None:
    rng = np.random.default_rng(1)
    for cls, n in classes.items():
        d = root / cls
        d.mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            im = Image.fromarray(arr).convert(mode)
            ext = "jpg" if fmt == "JPEG" else "png"
            im.save(d / f"{i:03d}.{ext}", format=fmt)


# --------------------------------------------------------------------------
# builder


def test_build_imagefolder_layout_counts_sizes(tmp_path):
    root = tmp_path / "folder"
    m = data.build_imagefolder(str(root), count=14, classes=4, seed=3, sources=_sources(),
                               workers=1, progress=False)
    assert m["count"] == 14 and m["classes"] == 4 and m["quality"] == 90
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert classes == ["class_00", "class_01", "class_02", "class_03"]
    counts = [len(list((root / c).iterdir())) for c in classes]
    assert counts == [4, 4, 3, 3]
    assert json.loads((root / "manifest.json").read_text())["seed"] == 3
    for c in classes:
        for f in (root / c).iterdir():
            assert f.suffix == ".jpg"
            with Image.open(f) as im:
                assert im.format == "JPEG" and im.mode == "RGB"
                im.load()
                assert 350 <= min(im.size) <= 500
    # no temporary folder left behind
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]


def test_build_imagefolder_deterministic_for_a_seed(tmp_path):
    def build(name, seed, workers):
        root = tmp_path / name
        data.build_imagefolder(str(root), count=16, classes=2, seed=seed, sources=_sources(),
                               short_side=(40, 60), workers=workers, progress=False)
        return {p.relative_to(root).as_posix(): p.read_bytes()
                for p in sorted(root.rglob("*.jpg"))}

    a = build("a", 7, workers=1)
    b = build("b", 7, workers=2)  # forked pool, same bytes
    c = build("c", 8, workers=1)
    assert a == b
    assert a.keys() == c.keys() and a != c
    for blob in a.values():  # short side honours the range given
        from io import BytesIO
        with Image.open(BytesIO(blob)) as im:
            assert 40 <= min(im.size) <= 60


def test_build_imagefolder_refuses_existing_and_bad_args(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(data.DataError, match="already exists"):
        data.build_imagefolder(str(tmp_path / "x"), count=2, classes=1, sources=_sources(1),
                               progress=False)
    with pytest.raises(data.DataError, match="count=1 and classes=2"):
        data.build_imagefolder(str(tmp_path / "y"), count=1, classes=2, sources=_sources(1),
                               progress=False)
    with pytest.raises(data.DataError, match="expected \\(H, W, 3\\)"):
        data.build_imagefolder(str(tmp_path / "z"), count=2, classes=1,
                               sources=[np.zeros((8, 8), np.uint8)], progress=False)


def test_skimage_photos_are_colour_photographs():
    pytest.importorskip("skimage")
    photos = dict(data.skimage_photos())
    assert {"astronaut", "chelsea", "coffee", "rocket"} <= set(photos)
    assert not {"camera", "coins", "chessboard_RGB", "color", "phantom", "logo"} & set(photos)
    for path in photos.values():
        with Image.open(path) as im:
            assert im.mode == "RGB"


def test_ensure_default_data_builds_once(tmp_path, monkeypatch):
    pytest.importorskip("skimage")
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    assert data.default_cache_dir() == str(tmp_path / "cache")
    lines = []
    root = data.ensure_default_data(count=10, classes=10, progress=False, log=lines.append)
    assert root.startswith(str(tmp_path / "cache")) and len(lines) == 1
    folder = data.scan_imagefolder(root)
    assert len(folder) == 10 and len(folder.classes) == 10
    stamp = os.stat(folder.paths[0]).st_mtime_ns
    assert data.ensure_default_data(count=10, classes=10, progress=False, log=lines.append) == root
    assert len(lines) == 1 and os.stat(folder.paths[0]).st_mtime_ns == stamp


def test_default_cache_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv(data.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert data.default_cache_dir() == str(tmp_path / "mploader")


# --------------------------------------------------------------------------
# scanning


def test_scan_imagefolder_lists_sorted_with_labels(tmp_path):
    _write_folder(tmp_path, {"b": 2, "a": 3})
    _write_folder(tmp_path / "c_png", {"x": 1}, fmt="PNG", mode="L")  # nested: c_png/x/000.png
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a" / ".DS_Store").write_bytes(b"junk")
    (tmp_path / "README.txt").write_text("ignored: not in a class folder")
    f = data.scan_imagefolder(str(tmp_path))
    assert f.classes == ["a", "b", "c_png"]
    assert f.labels.dtype == np.int64 and f.labels.tolist() == [0, 0, 0, 1, 1, 2]
    assert [os.path.basename(p) for p in f.paths[:3]] == ["000.jpg", "001.jpg", "002.jpg"]
    assert f.bytes == sum(os.path.getsize(p) for p in f.paths) and len(f) == 6


@pytest.mark.parametrize("case, pattern", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("empty", "is empty"),
    ("flat", "no class subfolders"),
    ("empty_class", "class folder 'b' has no image"),
    ("text", "not a JPEG or PNG image: .*notes.txt"),
    ("fake_jpg", "not a JPEG or PNG image: .*fake.jpg"),
])
def test_scan_imagefolder_errors_name_the_path(tmp_path, case, pattern):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case != "missing":
        root.mkdir()
    if case == "flat":
        Image.new("RGB", (8, 8)).save(root / "img.jpg")
    if case in ("empty_class", "text", "fake_jpg"):
        _write_folder(root, {"a": 2})
    if case == "empty_class":
        (root / "b").mkdir()
    if case == "text":
        (root / "a" / "notes.txt").write_text("not an image")
    if case == "fake_jpg":
        (root / "a" / "fake.jpg").write_bytes(b"GIF89a not really")
    with pytest.raises(data.DataError, match=pattern) as info:
        data.scan_imagefolder(str(root), what="argument --data: folder")
    assert str(info.value).startswith("argument --data: folder")


# --------------------------------------------------------------------------
# raw format


def test_build_raw_and_cache(tmp_path):
    _write_folder(tmp_path / "d", {"a": 2, "b": 1}, size=(50, 30))
    f = data.scan_imagefolder(str(tmp_path / "d"))
    lines = []
    ip, lp = data.ensure_raw(f, str(tmp_path / "cache"), progress=False, log=lines.append)
    imgs = np.load(ip, mmap_mode="r")
    assert imgs.shape == (3, 256, 256, 3) and imgs.dtype == np.uint8
    assert np.load(lp).tolist() == [0, 0, 1]
    # the centre of the square is the centre of the (upscaled) source image
    with Image.open(f.paths[0]) as im:
        src = np.asarray(im.convert("RGB").resize((427, 256), Image.Resampling.BILINEAR))
    assert np.abs(imgs[0].astype(int) - src[:, 85:341].astype(int)).mean() < 8
    assert data.ensure_raw(f, str(tmp_path / "cache"), progress=False, log=lines.append) == (ip, lp)
    assert len(lines) == 1
    assert not [p for p in os.listdir(os.path.dirname(ip)) if "tmp" in p]


# --------------------------------------------------------------------------
# pipeline


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 2000), width=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_random_resized_crop_params_in_range(height, width, seed):
    rng = np.random.default_rng(seed)
    top, left, h, w = pipeline.random_resized_crop_params(height, width, rng)
    assert 1 <= h and 1 <= w and 0 <= top and 0 <= left
    assert top + h <= height and left + w <= width
    # Whatever branch: the box's ratio is within 3/4..4/3 unless clamped by the
    # image's size (the fallback keeps the whole side).
    ratio = w / h
    if h < height and w < width:
        assert 0.75 * (1 - 2 / min(h, w)) - 1e-9 <= ratio <= 4 / 3 * (1 + 2 / min(h, w)) + 1e-9
        assert h * w <= height * width


def test_random_resized_crop_params_distribution_and_fallback():
    rng = np.random.default_rng(0)
    boxes = [pipeline.random_resized_crop_params(480, 640, rng) for _ in range(3000)]
    area = np.array([h * w for _, _, h, w in boxes]) / (480 * 640)
    ratio = np.array([w / h for _, _, h, w in boxes])
    assert 0.075 <= area.min() and area.max() <= 1.0 and 0.4 < area.mean() < 0.6
    assert 0.74 <= ratio.min() and ratio.max() <= 1.34
    assert len(set(boxes)) > 2900
    # An image far wider than 4/3: the attempts rarely fit; the fallback is the
    # center crop of the full height at ratio 4/3, exactly as torchvision's.
    assert pipeline.random_resized_crop_params(10, 1000, rng, scale=(0.99, 1.0)) == (0, 493, 10, 13)
    assert pipeline.random_resized_crop_params(1000, 10, rng, scale=(0.99, 1.0)) == (493, 0, 13, 10)
    # A square image with an impossible scale: the whole image.
    assert pipeline.random_resized_crop_params(50, 50, rng, scale=(2.0, 3.0)) == (0, 0, 50, 50)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    data.build_imagefolder(str(root / "f"), count=6, classes=2, seed=0, sources=_sources(),
                           short_side=(60, 90), workers=1, progress=False)
    f = data.scan_imagefolder(str(root / "f"))
    ip, lp = data.ensure_raw(f, str(root / "cache"), progress=False)
    return f, ip, lp


def _datasets(small_folder, **kw):
    f, ip, lp = small_folder
    return [pipeline.JpegDataset(f.paths, f.labels, **kw), pipeline.RawDataset(ip, lp, **kw)]


def test_pipeline_output_shape_dtype_label(small_folder):
    for ds in _datasets(small_folder, epochs=2):
        assert len(ds) == 12
        img, label = ds[7]
        assert img.shape == (224, 224, 3) and img.dtype == np.uint8
        assert isinstance(label, np.int64) and label == small_folder[0].labels[1]
        with pytest.raises(IndexError):
            ds[12]


def test_pipeline_deterministic_per_seed_epoch_index(small_folder):
    for a, b in zip(_datasets(small_folder, seed=5, epochs=3),
                    _datasets(small_folder, seed=5, epochs=3)):
        c = pickle.loads(pickle.dumps(a))
        for i in (0, 4, 9, 17):
            assert np.array_equal(a[i][0], b[i][0]) and np.array_equal(a[i][0], c[i][0])
    # index n + i of epoch 0 is index i of epoch 1
    for a, b in zip(_datasets(small_folder, epoch=0, epochs=2), _datasets(small_folder, epoch=1)):
        assert np.array_equal(a[6 + 2][0], b[2][0])


def test_pipeline_varies_with_index_epoch_seed(small_folder):
    for ds0, ds1 in zip(_datasets(small_folder, seed=0, epochs=2), _datasets(small_folder, seed=1)):
        assert not np.array_equal(ds0[0][0], ds0[6][0])  # same file, next epoch
        assert not np.array_equal(ds0[0][0], ds1[0][0])  # other seed
        assert not np.array_equal(ds0[0][0], ds0[1][0])  # other file


def test_different_index_gives_different_crop():
    boxes = {pipeline.random_resized_crop_params(400, 500, pipeline.sample_rng(0, 0, i))
             for i in range(50)}
    assert len(boxes) == 50
    flips = [pipeline.flip_draw(pipeline.sample_rng(0, 0, i)) for i in range(400)]
    assert 150 < sum(flips) < 250


def test_raw_dataset_is_nearest_neighbour_gather(tmp_path):
    # Pixel (y, x) holds (y, x, 7): the output says which source pixel it came from.
    y, x = np.mgrid[0:256, 0:256]
    img = np.stack([y, x, np.full_like(y, 7)], axis=-1).astype(np.uint8)[None]
    np.save(tmp_path / "i.npy", img)
    ds = pipeline.RawDataset(str(tmp_path / "i.npy"), np.array([3]), seed=2, epochs=40)
    flipped = 0
    for index in range(40):
        out, label = ds[index]
        rng = pipeline.sample_rng(2, index, 0)
        top, left, h, w = pipeline.random_resized_crop_params(256, 256, rng)
        flip = pipeline.flip_draw(rng)
        flipped += flip
        rows = top + np.floor((np.arange(224) + 0.5) * h / 224).astype(int)
        cols = left + np.floor((np.arange(224) + 0.5) * w / 224).astype(int)
        if flip:
            cols = cols[::-1]
        assert np.array_equal(out[:, 0, 0], rows) and np.array_equal(out[0, :, 1], cols)
        assert (out[..., 2] == 7).all() and label == 3
    assert 0 < flipped < 40


def test_jpeg_dataset_converts_to_rgb_and_flips(tmp_path):
    arr = np.zeros((300, 400), np.uint8)
    arr[:, :200] = 255  # left half white
    Image.fromarray(arr, "L").save(tmp_path / "g.png")
    ds = pipeline.JpegDataset([str(tmp_path / "g.png")], [0], epochs=200)
    seen = set()
    for i in range(200):
        out, _ = ds[i]
        assert out.shape == (224, 224, 3)
        rng = pipeline.sample_rng(0, i, 0)
        top, left, h, w = pipeline.random_resized_crop_params(300, 400, rng)
        flip = pipeline.flip_draw(rng)
        if left + w < 190:  # crop entirely in the white half: white everywhere
            assert out.min() > 240
        elif left > 210:
            assert out.max() < 15
        elif left + 10 < 200 < left + w - 10:  # straddles: white on the left unless flipped
            white_left = out[:, 0].mean() > out[:, -1].mean()
            assert white_left != flip
            seen.add(flip)
    assert seen == {False, True}


def test_decoder_info():
    info = pipeline.decoder_info()
    assert info["decoder"] == "Pillow" and info["version"] == PIL.__version__


# --------------------------------------------------------------------------
# the consumer and batches of the images suite


def test_consume_checks_layout_and_checksums():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 224, 224, 3), dtype=np.uint8)
    labels = np.arange(4, dtype=np.int64)
    crc, mean, problem = consume((images, labels), 4)
    assert problem is None and crc == batch_checksum(images, labels)
    assert math.isclose(mean, (images[..., 0].mean() - 123.675) / 58.395, rel_tol=1e-4)
    other = images.copy()
    other[3, 100, 100, 2] ^= 1
    assert consume((other, labels), 4)[0] != crc
    assert consume((images, labels[::-1].copy()), 4)[0] != crc
    assert "labels" in consume((images, labels.astype(np.int32)), 4)[2]
    assert "images" in consume((images[:3], labels), 4)[2]


def test_make_batches_prefix_and_passes():
    a = make_batches(10, 4, 5, seed=1)
    assert a == make_batches(10, 4, 8, seed=1)[:5]
    flat = np.concatenate(a)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10, 20))
    assert a != make_batches(10, 4, 5, seed=2)


def test_batch_checksum_crc32_fallback(monkeypatch):
    import zlib

    from mploader_bench import images

    x = np.arange(4 * 224 * 224 * 3, dtype=np.uint64).astype(np.uint8).reshape(4, 224, 224, 3)
    y = np.arange(4, dtype=np.int64)
    monkeypatch.setattr(images, "_xxhash", None)
    assert batch_checksum(x, y) == zlib.crc32(y, zlib.crc32(x))
    z = x.copy()
    z[2, 3, 4, 1] += 1
    assert batch_checksum(z, y) != batch_checksum(x, y)
