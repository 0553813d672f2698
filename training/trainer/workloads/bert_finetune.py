"""The guide's BERT fine-tuning (`accelerate launch --num_processes 4 train.py --model_name_or_path
bert-base-uncased ...`) as a `transformers.Trainer` script, checkpointed through our manager
(training/ckpt/hf.py): saved every CHECKPOINT_EVERY steps and on the spot notice, resumed from the
bucket on restart.

    # on CPU here: a tiny BERT built in code and synthetic sentences, nothing downloaded
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        -m training.trainer.workloads.bert_finetune --model_name_or_path tiny --max_steps 60
    # on a GPU node: a model in the image or on the data disk (no download at run time)
    accelerate launch -m training.trainer.workloads.bert_finetune --model_name_or_path /scratch/models/bert-base-uncased

Sentences are made from positive, negative and neutral words; the label says whether positive
words outnumber negative ones. The main process ends with
`final step=<N> loss=<last logged loss> params_sha256=<hex>`.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from training.ckpt.hf import SpotCheckpointCallback

POSITIVE = "good great fine excellent happy bright calm strong clear kind warm quick".split()
NEGATIVE = "bad poor awful sad dark weak slow cold harsh dull broken late".split()
NEUTRAL = "the a train model node cloud data step loss batch gpu spot run over with and".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentences(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pos, neg = rng.randint(0, 4), rng.randint(0, 4)
        words = [rng.choice(POSITIVE) for _ in range(pos)] + [rng.choice(NEGATIVE) for _ in range(neg)]
        words += [rng.choice(NEUTRAL) for _ in range(rng.randint(2, 8))]
        rng.shuffle(words)
        out.append((" ".join(words), int(pos > neg)))
    return out


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over the synthetic vocabulary, as a real fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + sorted(set(POSITIVE + NEGATIVE + NEUTRAL)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",  # type: ignore[no-untyped-call]
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def model_and_tokenizer(name: str, seed: int) -> tuple[Any, Any]:
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertConfig,
                              BertForSequenceClassification)

    if name == "tiny":
        tokenizer = tiny_tokenizer()
        torch.manual_seed(seed)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32)
        config.num_labels = 2
        return BertForSequenceClassification(config), tokenizer
    if not Path(name).is_dir():
        raise SystemExit(f"--model_name_or_path {name!r}: give 'tiny' or a local model folder (nodes download "
                         "nothing at run time: put the model in the image or the dataset)")
    return (AutoModelForSequenceClassification.from_pretrained(name, num_labels=2, local_files_only=True),
            AutoTokenizer.from_pretrained(name, local_files_only=True))


class Encoded(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, rows: list[tuple[str, int]], tokenizer: Any, length: int):
        enc = tokenizer([text for text, _ in rows], padding="max_length", truncation=True, max_length=length,
                        return_tensors="pt")
        self.ids, self.mask = enc["input_ids"], enc["attention_mask"]
        self.labels = torch.tensor([label for _, label in rows])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Record(TrainerCallback):
    """The logged losses (the last one is the run's final line), and an optional slow-down."""

    def __init__(self, sleep_ms: int):
        self.sleep_ms = sleep_ms
        self.losses: list[float] = []

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> Any:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000)


def params_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="BERT fine-tuning with spot-safe checkpoints", allow_abbrev=False)
    parser.add_argument("--model_name_or_path", default="tiny")
    parser.add_argument("--output_dir", default="out/bert")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--num_examples", type=int, default=400)
    parser.add_argument("--max_length", type=int, default=24)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sleep_ms", type=int, default=0, help="slow each step down (lets a test interrupt it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import Trainer

    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spot = SpotCheckpointCallback()  # first: it joins the process group the launcher describes
    model, tokenizer = model_and_tokenizer(args.model_name_or_path, args.seed)
    train = Encoded(sentences(args.num_examples, args.seed), tokenizer, args.max_length)
    record = Record(args.sleep_ms)

    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, seed=args.seed,
                              per_device_train_batch_size=args.per_device_train_batch_size,
                              learning_rate=args.learning_rate, logging_steps=1, save_strategy="no",
                              report_to=[], use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
                              disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=[spot, record])
    code = spot.train(trainer)
    if spot.stopped is None and not spot.done and trainer.is_world_process_zero():
        print(f"final step={trainer.state.global_step} loss={record.losses[-1] if record.losses else float('nan')!r} "
              f"params_sha256={params_sha256(model)}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
