"""Integrations with trainers that rebuild a user's loader (one module per trainer).

* :mod:`mploader.integrations.accelerate` -- ``prepare`` and ``skip_first_batches``
  that keep mploader's ring under Hugging Face Accelerate.

Lightning needs no module: it rebuilds ``mploader.torch.DataLoader`` from its public
attributes or from the constructor's recorded arguments (``mploader/torch.py``,
``_trainer_record``), and every argument survives.
"""
