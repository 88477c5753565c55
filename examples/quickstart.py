"""tessera quick start: train a 4-layer debug model in 4D, pp=2 x dp_shard=2 x cp=2 x tp=2 (16 ranks).

    torchrun --standalone --nproc_per_node 16 examples/quickstart.py

Each rank builds only its pipeline stage on the meta device, keeps only its shards, reads its dp slice
of every global batch and its zigzag chunks of each sequence (ring attention over cp); the 1F1B
schedule runs 2 microbatches per step; the losses equal a one-process run's.
"""

import torch.distributed as dist

from tessera.config import Config
from tessera.trainer import Trainer

dist.init_process_group("gloo")  # "nccl" with one GPU per rank
config = Config.create(
    model="debug",
    n_layers=4,
    pp=2,
    dp=2,
    cp=2,
    tp=2,
    sequence_parallel=True,
    microbatches=2,
    seq_len=64,
    global_batch=8,
    steps=5,
)
config.check()  # every input error, before any work
trainer = Trainer(config)  # meshes, meta build, parallelize, materialize, AdamW, data
for _ in range(config.runtime.steps):
    record = trainer.train_step().record()  # one host sync, here
    if dist.get_rank() == 0:
        print(f"step {record['step']}: loss {record['loss']:.4f}, grad norm {record['grad_norm']:.3f}")
dist.destroy_process_group()
