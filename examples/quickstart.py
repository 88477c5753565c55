"""tessera quick start: train the debug model on tp=2 x dp_shard=2 (4 ranks).

    torchrun --standalone --nproc_per_node 4 examples/quickstart.py

Each rank builds the model on the meta device, keeps only its shards, and reads its dp slice of every
global batch; the losses equal a one-process run's.
"""

import torch.distributed as dist

from tessera.config import Config
from tessera.trainer import Trainer

dist.init_process_group("gloo")  # "nccl" with one GPU per rank
config = Config.create(model="debug", tp=2, dp=2, sequence_parallel=True, seq_len=64, global_batch=8, steps=5)
config.check()  # every input error, before any work
trainer = Trainer(config)  # meshes, meta build, parallelize, materialize, AdamW, data
for _ in range(config.runtime.steps):
    record = trainer.train_step().record()  # one host sync, here
    if dist.get_rank() == 0:
        print(f"step {record['step']}: loss {record['loss']:.4f}, grad norm {record['grad_norm']:.3f}")
dist.destroy_process_group()
