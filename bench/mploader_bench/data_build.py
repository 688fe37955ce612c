"""Building the default ImageFolder from scikit-image's colour photographs (split
from :mod:`.data` to keep modules under ~600 lines)."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from .data import (
    _MANIFEST,
    _NOT_PHOTOS,
    _PHOTO_SUFFIXES,
    DEFAULT_CLASSES,
    DEFAULT_COUNT,
    DEFAULT_NAME,
    JPEG_QUALITY,
    SHORT_SIDE,
    DataError,
    _tqdm,
)


def skimage_photos() -> list[tuple[str, str]]:
    """The colour photographs shipped in scikit-image's ``skimage/data``.

    Every PNG/JPEG file there that Pillow opens as 3-channel RGB, minus the
    synthetic RGB pictures (``chessboard_RGB``, ``color``, ``phantom``); with
    scikit-image 0.26 that is astronaut, chelsea, coffee, hubble_deep_field,
    ihc, motorcycle_left, motorcycle_right, retina and rocket.

    Returns
    -------
    list of (str, str)
        ``(name, path)`` pairs sorted by name; ``name`` is the file stem.

    Raises
    ------
    DataError
        If scikit-image is not installed or ships no colour photograph.
    """
    try:
        import skimage
    except ImportError as exc:
        raise DataError("the default data is built from scikit-image's photographs, "
                        "but scikit-image is not installed: `make bench` installs it, "
                        "or pass --data DIR") from exc
    from PIL import Image

    data_dir = os.path.join(os.path.dirname(skimage.__file__), "data")
    photos = []
    for name in sorted(os.listdir(data_dir)):
        stem, ext = os.path.splitext(name)
        if ext.lower() not in _PHOTO_SUFFIXES or stem in _NOT_PHOTOS:
            continue
        path = os.path.join(data_dir, name)
        try:
            with Image.open(path) as im:
                if im.mode != "RGB" or getattr(im, "n_frames", 1) != 1:
                    continue
        except OSError:
            continue
        photos.append((stem, path))
    if not photos:
        raise DataError(f"no colour photograph found in {data_dir!r}")
    return photos


def _load_rgb(path: str) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


# --------------------------------------------------------------------------
# building the default ImageFolder

_build_sources: list[np.ndarray] = []


def _class_name(c: int) -> str:
    return f"class_{c:02d}"


def _plan(count: int, classes: int) -> list[tuple[int, int]]:
    """(class, index within class) of every image k = 0..count-1, round-robin."""
    return [(k % classes, k // classes) for k in range(count)]


def _make_image(k: int, seed: int, sources: Sequence[np.ndarray],
                short_side: tuple[int, int]) -> Any:
    """Image k of the build: a random crop of one source photo, rescaled and maybe flipped.

    Returns a PIL image in mode RGB whose short side is in `short_side`.
    """
    from PIL import Image

    rng = np.random.default_rng([seed, k])
    src = sources[int(rng.integers(len(sources)))]
    height, width = src.shape[:2]
    # A crop of 30-100 % of the photo's area, aspect ratio 3/4..4/3 (log-uniform).
    area = height * width * rng.uniform(0.3, 1.0)
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    w = min(width, max(16, int(round(math.sqrt(area * aspect)))))
    h = min(height, max(16, int(round(math.sqrt(area / aspect)))))
    top = int(rng.integers(0, height - h + 1))
    left = int(rng.integers(0, width - w + 1))
    short = int(rng.integers(short_side[0], short_side[1] + 1))
    scale = short / min(w, h)
    if w <= h:
        size = (short, max(short, int(round(h * scale))))
    else:
        size = (max(short, int(round(w * scale))), short)
    im = Image.fromarray(src)
    im = im.resize(size, Image.Resampling.BICUBIC, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return im


def _build_one(job: tuple[int, str, int, tuple[int, int], int]) -> int:
    k, path, seed, short_side, quality = job
    im = _make_image(k, seed, _build_sources, short_side)
    im.save(path, format="JPEG", quality=quality)
    return k


def build_imagefolder(root: str, *, count: int = DEFAULT_COUNT, classes: int = DEFAULT_CLASSES,
                      seed: int = 0, sources: Sequence[np.ndarray] | None = None,
                      short_side: tuple[int, int] = SHORT_SIDE, quality: int = JPEG_QUALITY,
                      workers: int | None = None, progress: bool = True) -> dict:
    """Build an ImageFolder of JPEG photographs at `root`.

    Image ``k`` (``0 <= k < count``) goes to class ``k % classes`` (folder
    ``class_XX``, file ``XXXXX.jpg``); it is a random crop (30--100 % of the
    area, aspect ratio 3/4--4/3) of a random source photo, rescaled (bicubic)
    to a short side drawn uniformly from `short_side`, flipped left-right with
    probability 0.5 and saved as JPEG at `quality`.  Its randomness comes from
    ``numpy.random.default_rng([seed, k])`` only, so the build is deterministic
    for a seed and can run in parallel.  The folder is built next to `root` and
    renamed into place, so a crashed build never leaves a half folder; a
    ``manifest.json`` at the root records the parameters.

    Parameters
    ----------
    root : str
        Folder to create; must not exist yet.
    count : int, optional
        Number of images (default 2,000), at least `classes`.
    classes : int, optional
        Number of class folders (default 10).
    seed : int, optional
        Seed of every random choice.
    sources : sequence of numpy.ndarray, optional
        Source photos, each ``(H, W, 3)`` uint8.  Default: the photographs of
        :func:`skimage_photos`.
    short_side : (int, int), optional
        Inclusive range of the short side in pixels (default 350--500).
    quality : int, optional
        JPEG quality, 1--95 (default 90).
    workers : int, optional
        Processes that encode in parallel (forked); default the CPU count.
    progress : bool, optional
        Show a tqdm progress bar on stderr.

    Returns
    -------
    dict
        The manifest written to ``root/manifest.json``.

    Raises
    ------
    DataError
        If `root` exists or an argument is out of range.
    """
    global _build_sources
    if count < 1 or classes < 1 or count < classes:
        raise DataError(f"count={count} and classes={classes}: need count >= classes >= 1")
    if not (short_side[0] >= 16 and short_side[1] >= short_side[0]):
        raise DataError(f"short_side={short_side!r}: need 16 <= low <= high")
    root = os.path.abspath(root)
    if os.path.exists(root):
        raise DataError(f"{root!r} already exists")
    if sources is None:
        photos = skimage_photos()
        names = [name for name, _ in photos]
        arrays = [_load_rgb(path) for _, path in photos]
    else:
        arrays = [np.ascontiguousarray(s, dtype=np.uint8) for s in sources]
        names = [f"source_{i}" for i in range(len(arrays))]
        for i, a in enumerate(arrays):
            if a.ndim != 3 or a.shape[2] != 3:
                raise DataError(f"sources[{i}] has shape {a.shape}; expected (H, W, 3)")
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(root) + ".building-", dir=parent)
    try:
        for c in range(classes):
            os.mkdir(os.path.join(tmp, _class_name(c)))
        jobs = [(k, os.path.join(tmp, _class_name(c), f"{k:05d}.jpg"), seed,
                 (short_side[0], short_side[1]), quality)
                for k, (c, _) in enumerate(_plan(count, classes))]
        workers = workers if workers is not None else (os.cpu_count() or 1)
        _build_sources = arrays
        bar = _tqdm(total=count, desc="building photo ImageFolder", unit="img", disable=not progress)
        try:
            if workers > 1 and count >= 4 * workers:
                import multiprocessing

                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    for _ in pool.imap_unordered(_build_one, jobs, chunksize=8):
                        bar.update(1)
            else:
                for job in jobs:
                    _build_one(job)
                    bar.update(1)
        finally:
            bar.close()
            _build_sources = []
        manifest = {
            "name": DEFAULT_NAME,
            "count": count,
            "classes": classes,
            "seed": seed,
            "short_side": list(short_side),
            "quality": quality,
            "sources": names,
        }
        with open(os.path.join(tmp, _MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
