"""Typing stub for the Cython module mploader._columns (see _columns.pyx)."""
from typing import Any

def uniform_arrays(samples: list[Any]) -> bool: ...
def number_column_dtype(samples: list[Any]) -> Any: ...
def fill_numbers(samples: list[Any], out: Any) -> bool: ...
def copy_rows(samples: list[Any], out: Any) -> bool: ...

STREAM_MIN_BYTES: int
HAVE_STREAM: bool

PLAN_KINDS: dict[str, int]
PLAN_DIMS: int

class BatchPlan:
    batch_size: int
    desc_off: int
    total: int
    descriptor: bytes
    def __init__(self, batch_size: int, in_tuple: bool, fields: list[tuple], descriptor: bytes,
                 desc_off: int) -> None: ...
    def fill(self, samples: list[Any], base: int, capacity: int) -> bool: ...
