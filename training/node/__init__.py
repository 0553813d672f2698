"""Node-side tools: what runs around the training processes on a GPU node or in a Job's pod.
They use the library in training/ (never the reference trainer's modules):

  entrypoint.sh    the image's entrypoint: the contract checked, the launcher started under the
                   guard, signals passed to the workers
  guard.py         runs the launcher so that nothing outlives the entrypoint
  rdzv_launch.py   torchrun with the rendezvous state signed under the group's key
  rdzv_store.py    the rendezvous store of a multi-node run
  datasync.py      the dataset copy from the bucket to local disk (`make dataset` too)
  node_replace.py  the replace-this-node request (the call itself: the cloud's node module,
                   infra/clouds/<cloud>/node.py); installed flat beside cloudmeta.py in
                   /usr/local/lib/gts on a VM node, imported by cloudinit/scripts/gts-gpu-health.py
"""
