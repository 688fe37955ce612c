"""Data for the images benchmark: the default photo ImageFolder, ImageFolder scanning, raw .npy.

Three jobs:

* :func:`build_imagefolder` / :func:`ensure_default_data` build, once, into a
  cache directory, an ImageFolder of real photographs: every colour photograph
  that scikit-image ships in ``skimage/data`` (:func:`skimage_photos`),
  expanded to about 2,000 JPEG files (quality 90, Pillow) in 10 class folders
  by random crops and rescales to a short side of 350--500 px (ImageNet-typical
  sizes).
* :func:`scan_imagefolder` lists any ImageFolder (one subfolder per class of
  JPEG/PNG files, the ImageNet train layout) and rejects what the benchmark
  cannot read, with a message that names the offending path.
* :func:`build_raw` / :func:`ensure_raw` decode the same images once to
  ``(N, 256, 256, 3)`` uint8 in one memory-mapped ``.npy`` file (the "raw"
  format of FFCV-style pipelines) plus an ``(N,)`` int64 labels file.

The cache directory is ``$MPLOADER_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/mploader``, else ``~/.cache/mploader``
(:func:`default_cache_dir`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CLASSES",
    "DEFAULT_COUNT",
    "DataError",
    "ImageFolder",
    "RAW_SIZE",
    "build_imagefolder",
    "build_raw",
    "default_cache_dir",
    "ensure_default_data",
    "ensure_raw",
    "scan_imagefolder",
    "skimage_photos",
]

#: Environment variable that overrides the cache directory.
CACHE_ENV = "MPLOADER_CACHE_DIR"
#: Name (and version) of the default ImageFolder inside the cache directory.
DEFAULT_NAME = "imagefolder-v1"
#: Number of JPEG files in the default ImageFolder.
DEFAULT_COUNT = 2000
#: Number of class folders in the default ImageFolder.
DEFAULT_CLASSES = 10
#: Range of the short side, in pixels, of the default ImageFolder's images.
SHORT_SIDE = (350, 500)
#: JPEG quality of the default ImageFolder.
JPEG_QUALITY = 90
#: Side, in pixels, of the square images of the raw format.
RAW_SIZE = 256

#: Files of ``skimage/data`` that are 3-channel RGB but not photographs.
_NOT_PHOTOS = frozenset({"chessboard_RGB", "color", "phantom"})
_PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg")
#: Suffixes scan_imagefolder accepts (compared lower-case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_MANIFEST = "manifest.json"


class DataError(ValueError):
    """A data folder or file that the benchmark cannot use; the message names it."""


# --------------------------------------------------------------------------
# cache directory


def default_cache_dir() -> str:
    """The directory that holds the benchmark's generated data.

    Returns
    -------
    str
        ``$MPLOADER_CACHE_DIR`` if set and non-empty, else
        ``$XDG_CACHE_HOME/mploader``, else ``~/.cache/mploader``.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "mploader")


# --------------------------------------------------------------------------
# source photographs


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


def ensure_default_data(cache_dir: str | None = None, *, count: int = DEFAULT_COUNT,
                        classes: int = DEFAULT_CLASSES, seed: int = 0,
                        progress: bool = True, log: Callable[[str], None] | None = None) -> str:
    """The default photo ImageFolder, built on first use.

    Parameters
    ----------
    cache_dir : str, optional
        Cache directory (default :func:`default_cache_dir`).
    count, classes, seed : int, optional
        Passed to :func:`build_imagefolder`; a folder built with other values
        (see its ``manifest.json``) is rebuilt under a suffixed name.
    progress : bool, optional
        Show a progress bar while building.
    log : callable, optional
        Called with one line of text when the folder is built.

    Returns
    -------
    str
        Absolute path of the ImageFolder.
    """
    cache_dir = os.path.abspath(cache_dir) if cache_dir else default_cache_dir()
    name = DEFAULT_NAME
    if (count, classes, seed) != (DEFAULT_COUNT, DEFAULT_CLASSES, 0):
        name = f"{DEFAULT_NAME}-n{count}-c{classes}-s{seed}"
    root = os.path.join(cache_dir, name)
    manifest = os.path.join(root, _MANIFEST)
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                m = json.load(f)
            if (m.get("count"), m.get("classes"), m.get("seed")) == (count, classes, seed):
                return root
        except (OSError, ValueError):
            pass
        shutil.rmtree(root)
    elif os.path.exists(root):
        shutil.rmtree(root)
    if log:
        log(f"building {count} JPEG photographs in {classes} classes into {root} (once)")
    build_imagefolder(root, count=count, classes=classes, seed=seed, progress=progress)
    return root


# --------------------------------------------------------------------------
# scanning an ImageFolder


@dataclass
class ImageFolder:
    """The files of an ImageFolder, sorted by class then file name.

    Attributes
    ----------
    root : str
        Absolute path of the folder.
    classes : list of str
        Class folder names, sorted; label ``i`` is ``classes[i]``.
    paths : list of str
        Absolute path of every image.
    labels : numpy.ndarray
        ``(len(paths),)`` int64, the class index of each image.
    bytes : int
        Total size of the image files, in bytes.
    """

    root: str
    classes: list[str]
    paths: list[str]
    labels: np.ndarray = field(repr=False)
    bytes: int = 0

    def __len__(self) -> int:
        return len(self.paths)


def _image_kind(path: str) -> str | None:
    """'jpeg' or 'png' from the file's first bytes, else None."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def scan_imagefolder(root: str, *, what: str = "folder") -> ImageFolder:
    """List the images of an ImageFolder: one subfolder per class of JPEG/PNG files.

    Hidden files and folders (name starting with ``.``) are skipped, and so are
    files directly in `root` that are not images (a README, a manifest).
    Every other file in a class folder must be a JPEG or PNG image (checked by
    suffix and by its first bytes).  Class folders that hold no image are an
    error too, as torchvision's ``ImageFolder`` has it.

    Parameters
    ----------
    root : str
        The folder.
    what : str, optional
        How error messages name the folder (e.g. ``"argument --data: folder"``).

    Returns
    -------
    ImageFolder

    Raises
    ------
    DataError
        If `root` does not exist or is not a folder, has no class subfolder, a
        class folder is empty, or a file is not a JPEG/PNG image; the message
        names the path.
    """
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.exists(root):
        raise DataError(f"{what} {root!r} does not exist")
    if not os.path.isdir(root):
        raise DataError(f"{what} {root!r} is not a directory")
    classes, stray = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            classes.append(entry.name)
        elif os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES:
            stray.append(entry.name)
    if not classes:
        if stray:
            raise DataError(f"{what} {root!r} has images but no class subfolders "
                            f"(e.g. {stray[0]!r}); expected one subfolder per class "
                            f"of JPEG/PNG files")
        raise DataError(f"{what} {root!r} is empty: expected one subfolder per class "
                        f"of JPEG/PNG files")
    paths: list[str] = []
    labels: list[int] = []
    total = 0
    for label, cls in enumerate(classes):
        cdir = os.path.join(root, cls)
        n = 0
        for dirpath, dirnames, filenames in os.walk(cdir, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = os.path.join(dirpath, name)
                if (os.path.splitext(name)[1].lower() not in IMAGE_SUFFIXES
                        or _image_kind(path) is None):
                    raise DataError(f"{what} {root!r} holds a file that is not a JPEG or "
                                    f"PNG image: {path!r}")
                total += os.path.getsize(path)
                paths.append(path)
                labels.append(label)
                n += 1
        if n == 0:
            raise DataError(f"{what} {root!r}: class folder {cls!r} has no image")
    return ImageFolder(root=root, classes=classes, paths=paths,
                       labels=np.asarray(labels, dtype=np.int64), bytes=total)


# --------------------------------------------------------------------------
# raw format


def _decode_square(path: str, size: int) -> np.ndarray:
    """Decode, resize the short side to `size` (bilinear, antialiased), center-crop."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        nw, nh = max(size, int(round(w * scale))), max(size, int(round(h * scale)))
        left, top = (nw - size) // 2, (nh - size) // 2
        # Resize then crop in one call: box is in source coordinates.
        box = (left / scale, top / scale, (left + size) / scale, (top + size) / scale)
        out = im.resize((size, size), Image.Resampling.BILINEAR, box=box)
        return np.asarray(out)


def _raw_key(folder: ImageFolder, size: int) -> str:
    h = hashlib.sha1()
    h.update(f"raw-v1 {size} {folder.root}\n".encode())
    for path, label in zip(folder.paths, folder.labels.tolist()):
        st = os.stat(path)
        h.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build_raw(folder: ImageFolder, images_path: str, labels_path: str, *,
              size: int = RAW_SIZE, progress: bool = True) -> None:
    """Decode every image of `folder` once into one ``.npy`` file.

    Each image is resized (bilinear, antialiased) so that its short side is
    `size` and center-cropped to ``size x size``.  The files are written under
    temporary names and renamed into place.

    Parameters
    ----------
    folder : ImageFolder
        The images, from :func:`scan_imagefolder`.
    images_path : str
        Output ``.npy``: ``(N, size, size, 3)`` uint8, N = ``len(folder)``.
    labels_path : str
        Output ``.npy``: ``(N,)`` int64.
    size : int, optional
        Side of the square images in pixels (default 256).
    progress : bool, optional
        Show a tqdm progress bar.
    """
    os.makedirs(os.path.dirname(os.path.abspath(images_path)), exist_ok=True)
    tmp_images = images_path + ".tmp.npy"
    tmp_labels = labels_path + ".tmp.npy"
    out = np.lib.format.open_memmap(tmp_images, mode="w+", dtype=np.uint8,
                                    shape=(len(folder), size, size, 3))
    try:
        for i, path in enumerate(_tqdm(folder.paths, desc=f"decoding to raw {size}x{size}",
                                       unit="img", disable=not progress)):
            out[i] = _decode_square(path, size)
        out.flush()
        del out
        np.save(tmp_labels, folder.labels.astype(np.int64))
        os.replace(tmp_labels, labels_path)
        os.replace(tmp_images, images_path)
    except BaseException:
        for p in (tmp_images, tmp_labels):
            if os.path.exists(p):
                os.unlink(p)
        raise


def ensure_raw(folder: ImageFolder, cache_dir: str | None = None, *, size: int = RAW_SIZE,
               progress: bool = True, log: Callable[[str], None] | None = None) -> tuple[str, str]:
    """The raw ``.npy`` files of `folder`, built on first use.

    The files live in ``cache_dir/raw/`` under a key made of the folder's path,
    its files' names, sizes and modification times, and `size`; a changed
    folder gets new files.

    Parameters
    ----------
    folder : ImageFolder
        The images.
    cache_dir : str, optional
        Cache directory (default :func:`default_cache_dir`).
    size : int, optional
        Side of the square images (default 256).
    progress : bool, optional
        Show a progress bar while building.
    log : callable, optional
        Called with one line of text when the files are built.

    Returns
    -------
    (str, str)
        Paths of the images ``.npy`` (``(N, size, size, 3)`` uint8) and of the
        labels ``.npy`` (``(N,)`` int64).
    """
    cache_dir = os.path.abspath(cache_dir) if cache_dir else default_cache_dir()
    key = _raw_key(folder, size)
    images_path = os.path.join(cache_dir, "raw", f"images-{size}-{key}.npy")
    labels_path = os.path.join(cache_dir, "raw", f"labels-{size}-{key}.npy")
    if os.path.isfile(images_path) and os.path.isfile(labels_path):
        return images_path, labels_path
    if log:
        log(f"decoding {len(folder)} images to {size}x{size}x3 uint8 into {images_path} (once)")
    build_raw(folder, images_path, labels_path, size=size, progress=progress)
    return images_path, labels_path


def _tqdm(*args: Any, **kw: Any) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is optional
        class _Null:
            def __init__(self, iterable: Any = None, **_: Any) -> None:
                self._it = iterable

            def __iter__(self) -> Any:
                return iter(self._it)

            def update(self, n: int = 1) -> None:
                pass

            def set_description_str(self, *a: Any, **k: Any) -> None:
                pass

            def set_postfix_str(self, *a: Any, **k: Any) -> None:
                pass

            def close(self) -> None:
                pass

        return _Null(*args, **kw)
    kw.setdefault("mininterval", 0.5)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(*args, **kw)
