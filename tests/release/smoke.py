"""What an installed mploader must do on a fresh machine: run by tests/release/*.sh in a
fresh venv, from a directory outside the checkout (so the installed package is the one
imported, never the source tree).

Two workers load two epochs of a map-style dataset; every batch is compared with the
batch built in this process, and the batches must have come through the ring's slots
(``stats()['slot']``), not only the pickle fallback.  Exit status 0 and one line on
stdout naming the installed file, Python and NumPy versions on success.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mploader


class Samples:
    """64 samples: an (4, 3) int32 array filled with the index, and the index."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return np.full((4, 3), i, np.int32), i


def main() -> int:
    checkout = os.environ.get("MPLOADER_CHECKOUT")
    if checkout and os.path.dirname(os.path.abspath(mploader.__file__)) == os.path.join(checkout, "mploader"):
        print(f"imported the checkout's mploader ({mploader.__file__}), not the installed one")
        return 1
    with mploader.DataLoader(Samples(), batch_size=8, shuffle=True, num_workers=2, seed=3) as loader:
        for epoch in range(2):
            seen = []
            for images, labels in loader:
                assert images.shape == (8, 4, 3) and images.dtype == np.int32, (images.shape, images.dtype)
                np.testing.assert_array_equal(images, np.broadcast_to(np.asarray(labels)[:, None, None], (8, 4, 3)))
                seen.extend(int(i) for i in labels)
            assert sorted(seen) == list(range(64)), f"epoch {epoch}: {sorted(seen)}"
        stats = loader.stats()
    assert stats["slot"] == 16 and stats["fallback_pipe"] == 0, stats
    print(f"ok: {mploader.__file__} python {sys.version.split()[0]} numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
