"""FSDP2 over sequence parallel returned a view from the embedding unit, and FSDP2 warned once per rank that an
in-place op on it could skip its pre-backward hook ("returned a view tensor"): the vocab-parallel embedding
returns a tensor of its own, so the warning cannot apply and is not printed."""

import warnings

import torch

from helpers import small_config
from tessera.launching.launch import run_ranks


def _warnings_of_a_step(config):
    from tessera.trainer import Trainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(config, torch.device("cpu"))
        trainer.train_step().record()
    return [str(w.message) for w in caught]


def test_dp2_tp2_sequence_parallel_returns_no_view_from_an_fsdp_unit():
    config = small_config(dp=2, tp=2, sequence_parallel=True, steps=1)
    for messages in run_ranks(_warnings_of_a_step, 4, config, timeout=180):
        assert not [m for m in messages if "returned a view tensor" in m], messages
