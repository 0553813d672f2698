"""Our reference trainer, built on the library in training/ (it imports the library; the library
never imports it):

  train.py       the training loop: load -> loop -> save (`python -m training.trainer.train --help`)
  early.py       what train.py does before it imports torch: the bucket's newest step fetched meanwhile
  config.py      its options, each with the trainer-contract variable that sets it
  data.py        datasets and the resumable sampler
  models.py      TinyNet, TinyGPT, ResNet-50
  metrics.py     its Prometheus metrics (gts_*)
  tracking.py    MLflow tracking, when MLFLOW_TRACKING_URI is set
  bench.py       checkpoint and resume figures (`make bench`, `python -m training.trainer.bench`)
  workloads/     Hugging Face workloads run through the library's callback (bert_finetune.py)

The image's entrypoint (training/node/entrypoint.sh) runs train.py unless the stack's
training.command names your own code.
"""
