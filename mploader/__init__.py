"""mploader: forked data-loading workers that collate batches straight into a
shared-memory slot ring; the training loop receives zero-copy numpy views."""
from . import batchify, sampler
from ._bad_samples import BadSampleBudgetError
from ._collate import default_batchify
from ._diagnose import Diagnosis, diagnose, set_postfix
from ._engine import WorkerError
from ._memory import set_memory_budget
from ._version import __version__ as __version__
from ._watchdog import StallError
from .dataloader import DataLoader
from .distributed import DistributedBatchSampler
from .iterators import MultiprocessIterator, OrderSampler, ShuffleOrderSampler
from .sampler import BatchSampler, FilterSampler, IntervalSampler, RandomSampler, Sampler, SequentialSampler
from .sharded import ShardedDataLoader
from .shared import SharedList

__all__ = [
    "DataLoader",
    "DistributedBatchSampler",
    "WorkerError",
    "StallError",
    "BadSampleBudgetError",
    "diagnose",
    "Diagnosis",
    "set_postfix",
    "set_memory_budget",
    "default_batchify",
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "BatchSampler",
    "FilterSampler",
    "IntervalSampler",
    "MultiprocessIterator",
    "OrderSampler",
    "ShuffleOrderSampler",
    "ShardedDataLoader",
    "SharedList",
    "sampler",
    "batchify",
]
