"""Spot-safe checkpointing for PyTorch training, and what runs it on the stack's GPU nodes.

Three audiences, three places; imports point one way only: trainer -> library and node -> library;
the library imports neither, and neither subpackage imports the other (tests/test_structure.py).

training/            THE LIBRARY: what you import into your own training code.
  ckpt/              the checkpoint library (its map: training/ckpt/__init__.py):
    checkpointer.py  Checkpointer: save / resume / emergency checkpoint in three lines
    hf.py            SpotCheckpointCallback for Hugging Face transformers.Trainer / accelerate
    lightning.py     SpotCheckpoint for PyTorch Lightning
    manager.py       CheckpointManager: atomic commit, sha256 manifest, background upload, keep-K
    sharded.py       sharded state (FSDP2 / DTensor) through the manager
    storage.py       s3:// oss:// cosn:// file:// through fsspec
    peer/            the in-memory peer tier under the durable checkpoints
  checkpointing.py, checkpoint.py, hf.py, lightning_spot.py, sharded.py: the old import paths,
                     kept as re-exports of training/ckpt/ (compatibility)
  loaders.py         a DataLoader's position and randomness as checkpointed state
  credentials.py     the bucket's credentials (instance role, a pod's own role)
  cloudmeta.py       the metadata service and signed object reads, standard library only (also
                     the node's bundle fetcher, installed in /usr/local/lib/gts); what is one
                     cloud's comes from infra/clouds/<cloud>/metadata.py and node.py, which it
                     loads by path (the image carries them)
  contract.py        the environment variables the stack hands a training container
  distributed.py     torchrun / accelerate / Horovod behind one interface
  goodput.py         the checkpoint interval under preemption (`python -m training.goodput`)
  wallcost.py        a checkpoint's whole wall-time cost to the loop

training/trainer/    OUR REFERENCE TRAINER, built on the library (`python -m training.trainer.train`,
                     `python -m training.trainer.bench`, workloads/ for Hugging Face examples).

training/node/       NODE-SIDE TOOLS: the image's entrypoint (node/entrypoint.sh), the launcher's
                     guard, the signed rendezvous (launch, store), the warm start that forks
                     workers with torch already loaded (warm.py), the dataset copy and the
                     node's replace-me call.

Dockerfile and requirements.txt build the training image from all three.
"""
