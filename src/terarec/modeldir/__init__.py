"""The model directory: what training writes and everyone else reads (evaluation,
prediction, export, slices, search, ``terarec inspect``), without a trainer.

::

    model_dir/
      schema.json                 FeatureSchema: how raw rows become keys
      train_config.json           TrainConfig used
      checkpoints/
        pass-000003/              one committed pass (older ones pruned)
          dense.safetensors       model weights                  (rank 0; equal on all)
          dense_optimizer.pt      dense optimizer state          (rank 0)
          sparse/                 one process: what ``store.save`` wrote; for a memory
            rows.safetensors        store keys (sorted) + values + optimizer state +
                                    counters; for a tiered store (docs/tiered-store.md):
            slab-NNNNNN.bin         disk-tier slabs, hard-linked from the previous
                                    checkpoint where unchanged since it
            index.safetensors       key -> slot
            store.safetensors       admission candidates, counters
          sparse-0000R-of-0000N/  instead, N torchrun ranks: rank R's keys, saved the same
                                  way by its store
          dense_comm-0000R-of-0000N.pt  rank R's unsent DGC residuals (dgc only)
          meta.json               pass id, world size, shard list, history, sha256 of
                                  each file: written last, by rank 0
      LATEST                      name of the newest committed checkpoint
      BEST                        name of the best one on the validation set (training
                                  with --valid): kept out of pruning; what eval, predict
                                  and export load unless told otherwise

One process writes one shard (``sparse/``), N ranks one each. Checkpoints from before
this layout still load: ``sparse.safetensors`` (one process, before stores saved
themselves) and ``sparse-0000R-of-0000N.safetensors`` files (N ranks).

``layout`` names the files and pointers, ``manifest`` validates ``meta.json``,
``commit`` writes a checkpoint atomically, ``checkpoint`` reads one back. A trainer is
built from a checkpoint by ``terarec.train.Trainer.from_checkpoint``.
"""

from terarec.modeldir.checkpoint import (
    LoadedCheckpoint,
    choose_checkpoint,
    load_checkpoint,
    merge_shards,
    rank_arrays,
)
from terarec.modeldir.commit import (
    TrainingState,
    save_checkpoint,
    store_summary,
    sum_store_summaries,
)
from terarec.modeldir.layout import (
    BEST_FILE,
    KEEP_CHECKPOINTS,
    LATEST_FILE,
    CheckpointError,
    best_checkpoint,
    checkpoint_name,
    clear_best,
    comm_file,
    list_checkpoints,
    mark_best,
    pass_name,
    read_model_meta,
    shard_name,
    write_model_meta,
    write_train_config,
)
from terarec.modeldir.manifest import CheckpointMeta, checkpoint_meta, verify_checkpoint
from terarec.modeldir.ranks import Ranks

__all__ = [
    "BEST_FILE", "KEEP_CHECKPOINTS", "LATEST_FILE", "CheckpointError", "CheckpointMeta",
    "LoadedCheckpoint", "Ranks", "TrainingState", "best_checkpoint", "checkpoint_meta",
    "checkpoint_name", "choose_checkpoint", "clear_best", "comm_file", "list_checkpoints",
    "load_checkpoint", "mark_best", "merge_shards", "pass_name", "rank_arrays",
    "read_model_meta", "save_checkpoint", "shard_name", "store_summary",
    "sum_store_summaries", "verify_checkpoint", "write_model_meta", "write_train_config",
]
