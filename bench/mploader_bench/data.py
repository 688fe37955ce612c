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
import os
import shutil
from collections.abc import Callable
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
SHORT_SIDE: tuple[int, int] = (350, 500)
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


# Split out to keep modules under ~600 lines; imported last (it uses this module's names).
from .data_build import build_imagefolder, skimage_photos  # noqa: E402
