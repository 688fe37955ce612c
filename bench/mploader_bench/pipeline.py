"""The images benchmark's datasets: the standard ImageNet training transform.

Both datasets yield ``(image, label)`` samples with ``image`` of shape
``(224, 224, 3)`` uint8 (height, width, RGB) and ``label`` an int64 scalar, so
that a batch is ``(B, 224, 224, 3)`` uint8 plus ``(B,)`` int64.

:class:`JpegDataset`
    decode (Pillow), RandomResizedCrop to 224 (scale 0.08--1, ratio
    3/4--4/3, bilinear with antialiasing, as torchvision's default on PIL
    images), horizontal flip with probability 0.5.
:class:`RawDataset`
    images pre-decoded to ``(N, 256, 256, 3)`` uint8 in one memory-mapped
    ``.npy`` file: the same RandomResizedCrop parameters, resampled by nearest
    neighbour, which with the flip is a single gather of pixels (the per-sample
    work of an FFCV-style "raw" pipeline, so that transport dominates).

Randomness: sample ``index`` of a dataset made with ``seed`` and ``epoch``
draws everything from ``numpy.random.default_rng([seed, epoch + index // n,
index % n])`` where ``n`` is the number of images; indices past ``n`` are the
next epochs (the dataset's length is ``n * epochs``).  No state lives in the
dataset, so forked workers, a pool or the calling process all produce the
same bytes for the same index.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "OUTPUT_SIZE",
    "JpegDataset",
    "RawDataset",
    "decoder_info",
    "flip_draw",
    "random_resized_crop_params",
    "sample_rng",
]

#: Side of the output images, in pixels.
OUTPUT_SIZE = 224
#: RandomResizedCrop's default range of the crop's area, as a fraction of the image's.
SCALE = (0.08, 1.0)
#: RandomResizedCrop's default range of the crop's aspect ratio (width / height).
RATIO = (3 / 4, 4 / 3)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample: ``numpy.random.default_rng([seed, epoch, index])``.

    Parameters
    ----------
    seed, epoch, index : int
        Non-negative integers.

    Returns
    -------
    numpy.random.Generator
    """
    return np.random.default_rng([int(seed), int(epoch), int(index)])


def random_resized_crop_params(height: int, width: int, rng: np.random.Generator,
                               scale: tuple[float, float] = SCALE,
                               ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """Pick a RandomResizedCrop box: torchvision's algorithm, numpy's generator.

    Up to 10 attempts draw an area fraction uniformly from `scale` and an aspect
    ratio log-uniformly from `ratio`; the first box that fits in the image is
    placed uniformly at random.  If none fits, the fallback is a center crop:
    the whole image, clamped to the nearest ratio in `ratio`.

    Parameters
    ----------
    height, width : int
        Size of the image in pixels, both >= 1.
    rng : numpy.random.Generator
        Source of randomness (advanced by 2 draws per attempt, 2 more on success).
    scale : (float, float), optional
        Range of the crop's area as a fraction of the image's area.
    ratio : (float, float), optional
        Range of the crop's aspect ratio, width / height.

    Returns
    -------
    (int, int, int, int)
        ``(top, left, h, w)`` in pixels with ``0 <= top``, ``top + h <= height``,
        ``0 <= left``, ``left + w <= width``, ``h, w >= 1``.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    # Fallback to a center crop.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:  # the whole image
        w = width
        h = height
    top = (height - h) // 2
    left = (width - w) // 2
    return top, left, h, w


def flip_draw(rng: np.random.Generator) -> bool:
    """Whether to flip left-right: one uniform draw, True with probability 0.5."""
    return bool(rng.random() < 0.5)


def decoder_info() -> dict:
    """The JPEG decoder the pipeline uses.

    Returns
    -------
    dict
        ``decoder`` ("Pillow"), ``version`` (Pillow's), ``libjpeg`` (the libjpeg
        version Pillow was built with, or None) and ``libjpeg_turbo`` (bool).
    """
    import PIL
    from PIL import features

    libjpeg = features.version("jpg")  # None when built without JPEG support
    turbo = bool(features.check_feature("libjpeg_turbo"))  # both exist since Pillow 9
    return {"decoder": "Pillow", "version": PIL.__version__, "libjpeg": libjpeg,
            "libjpeg_turbo": turbo}


class _Base:
    """Shared index arithmetic of the two datasets."""

    def __init__(self, labels: Any, *, seed: int, epoch: int, epochs: int, size: int) -> None:
        self.labels = np.asarray(labels, dtype=np.int64)
        if self.labels.ndim != 1 or len(self.labels) == 0:
            raise ValueError(f"labels: expected a non-empty (N,) array, got shape {self.labels.shape}")
        if epochs < 1:
            raise ValueError(f"epochs={epochs}: must be >= 1")
        if size < 1:
            raise ValueError(f"size={size}: must be >= 1")
        self.n = len(self.labels)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.epochs = int(epochs)
        self.size = int(size)

    def __len__(self) -> int:
        return self.n * self.epochs

    def _locate(self, index: int) -> tuple[int, int]:
        index = int(index)
        if not 0 <= index < self.n * self.epochs:
            raise IndexError(f"index {index} out of range for a dataset of length "
                             f"{self.n * self.epochs}")
        return self.epoch + index // self.n, index % self.n


class JpegDataset(_Base):
    """Image files decoded with Pillow, RandomResizedCrop to 224, random flip.

    Parameters
    ----------
    paths : sequence of str
        JPEG/PNG files, N of them.
    labels : array_like
        ``(N,)`` integer class of each file.
    seed : int, optional
        Seed of the augmentation.
    epoch : int, optional
        Epoch of index 0 (see the module docstring).
    epochs : int, optional
        Number of passes the indices cover: the length is ``N * epochs``.
    size : int, optional
        Output side in pixels (default 224).

    Examples
    --------
    ``ds[i]`` is ``(image, label)``: ``image`` ``(224, 224, 3)`` uint8,
    ``label`` ``numpy.int64``.
    """

    def __init__(self, paths: Sequence[str], labels: Any, *, seed: int = 0, epoch: int = 0,
                 epochs: int = 1, size: int = OUTPUT_SIZE) -> None:
        super().__init__(labels, seed=seed, epoch=epoch, epochs=epochs, size=size)
        self.paths = list(paths)
        if len(self.paths) != self.n:
            raise ValueError(f"paths has {len(self.paths)} entries but labels has {self.n}")

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        from PIL import Image

        epoch, i = self._locate(index)
        rng = sample_rng(self.seed, epoch, i)
        with Image.open(self.paths[i]) as im:
            if im.mode != "RGB":
                im = im.convert("RGB")
            else:
                im.load()
            width, height = im.size
            top, left, h, w = random_resized_crop_params(height, width, rng)
            out = im.resize((self.size, self.size), Image.Resampling.BILINEAR,
                            box=(left, top, left + w, top + h))
        if flip_draw(rng):
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out), self.labels[i]


class RawDataset(_Base):
    """Pre-decoded images in a memory-mapped ``.npy``: RandomResizedCrop by gather, flip.

    The crop box is drawn exactly as in :class:`JpegDataset`; the resize to
    ``size x size`` picks, for output pixel ``(y, x)``, the source pixel
    ``(top + floor((y + 0.5) * h / size), left + floor((x + 0.5) * w / size))``
    (nearest neighbour, pixel centers), with the column order reversed when
    flipped.  The memory map is opened lazily in each process.

    Parameters
    ----------
    images_path : str
        ``.npy`` file of ``(N, H, W, 3)`` uint8 images.
    labels : array_like or str
        ``(N,)`` integer labels, or the path of a ``.npy`` file holding them.
    seed, epoch, epochs, size : int, optional
        As for :class:`JpegDataset`.
    """

    def __init__(self, images_path: str, labels: Any, *, seed: int = 0, epoch: int = 0,
                 epochs: int = 1, size: int = OUTPUT_SIZE) -> None:
        if isinstance(labels, str):
            labels = np.load(labels)
        super().__init__(labels, seed=seed, epoch=epoch, epochs=epochs, size=size)
        self.images_path = images_path
        self._images: np.ndarray | None = None
        images = self.images
        if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
            raise ValueError(f"{images_path!r}: expected (N, H, W, 3) uint8, "
                             f"got {images.shape} {images.dtype}")
        if images.shape[0] != self.n:
            raise ValueError(f"{images_path!r} holds {images.shape[0]} images but there are "
                             f"{self.n} labels")
        self._centers = (np.arange(self.size) + 0.5) / self.size  # (size,) float64

    @property
    def images(self) -> np.ndarray:
        """The ``(N, H, W, 3)`` uint8 memory map (read-only)."""
        if self._images is None:
            # A plain ndarray view: np.memmap's Python-level __array_finalize__
            # would run on every slice and gather of every sample.
            self._images = np.asarray(np.load(self.images_path, mmap_mode="r"))
        return self._images

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_images"] = None
        return state

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        epoch, i = self._locate(index)
        rng = sample_rng(self.seed, epoch, i)
        img = self.images[i]
        height, width = img.shape[:2]
        top, left, h, w = random_resized_crop_params(height, width, rng)
        rows = top + (self._centers * h).astype(np.intp)
        cols = left + (self._centers * w).astype(np.intp)
        if flip_draw(rng):
            cols = cols[::-1]
        # Whole rows first (contiguous copies), then one byte-level gather per row.
        picked = img.reshape(height, width * 3).take(rows, axis=0)
        byte_cols = (3 * cols[:, None] + np.arange(3)).ravel()
        out = picked.take(byte_cols, axis=1)
        return out.reshape(self.size, self.size, 3), self.labels[i]
