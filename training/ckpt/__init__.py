"""The checkpoint library (issue 45): spot-safe checkpoints for a PyTorch loop, in one package.
Importing the package imports nothing else (infra/ reads storage.py without torch).

Where things are, top down:
  checkpointer.py  Checkpointer: save / resume / emergency checkpoint in three lines
  hf.py            SpotCheckpointCallback for Hugging Face transformers.Trainer / accelerate
  lightning.py     SpotCheckpoint for PyTorch Lightning
  sharded.py       sharded state (FSDP2 / DTensor) through the manager
  run_control.py   which step to resume, the checkpoint interval, the stop flag, exit codes
  manager.py       CheckpointManager: atomic commit, sha256 manifest, keep-K; it holds
  uploader.py        the background upload to the bucket, and
  loader.py          the verified load from disk or bucket (memory.py: fetched into memory;
                     prefetch.py: the newest step loaded while the model is built;
                     fetch_process.py: fetched by a process of its own, fetcher.py its code,
                     fetch_place.py where and with what settings; it takes the lease for rank 0)
  tiers.py         Tier: where a step comes from (steps, load); the disk and the bucket
                   (loader.py) and the peer tier (peer/tier.py) are its three
  files.py         the layout: step folders, manifests, topology, errors
  staging.py       the state copied into reused buffers, hashed while it is written
  restore.py       a loaded state put back into a model and optimizer without a second copy
  storage.py       s3:// oss:// cosn:// file:// through fsspec (fetch.py: one verified GET)
  digest.py        the manifest's piece hashes
  lease.py         the run's lease on its bucket prefix (one writer per run)
  peer/            the in-memory peer tier under the durable checkpoints (docs/recovery.md)

The old flat paths training.checkpointing, training.checkpoint, training.hf,
training.lightning_spot and training.sharded stay as re-exports for code written against them.
"""
