"""Experiment tracking (Accelerate's by_feature/tracking.py): ``log_with="tensorboard"``,
``project_dir``, ``init_trackers`` with the run's hyperparameters, ``log`` every step and
each epoch, ``end_training``. Rank 0 then reads the TensorBoard event files back.
"""

import argparse
import glob
import json
import os
import struct

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

VOCAB, SEQ_LEN = 96, 16


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > SEQ_LEN).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(size)]


def read_scalars(event_dir):
    """{tag: [[step, value], ...]} from the TensorBoard event files directly in event_dir."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 16 + length
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") else None
                if number is None and value.tensor.float_val:
                    number = value.tensor.float_val[0]
                if number is not None:
                    scalars.setdefault(value.tag, []).append([event.step, round(number, 6)])
    return scalars


def main():
    parser = argparse.ArgumentParser(description="TensorBoard tracking.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    hyperparameters = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": 13, "batch_size": 8}
    accelerator.init_trackers("parity_run", config=hyperparameters)

    set_seed(hyperparameters["seed"])
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ_LEN,
            num_labels=2,
        )
    )
    loader = DataLoader(synthetic_reviews(64, seed=14), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer, num_warmup_steps=3)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    overall_step = 0
    for epoch in range(args.num_epochs):
        model.train()
        total_loss = 0.0
        for batch in loader:
            loss = model(**batch).loss
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            accelerator.log(
                {"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=overall_step
            )
        accelerator.log(
            {"epoch": epoch, "epoch_loss": total_loss.item() / len(loader)}, step=overall_step
        )
    accelerator.end_training()  # may end the process group too: no collective after it

    if accelerator.is_main_process:
        run_dir = os.path.join(args.output_dir, "parity_run")
        hparams = glob.glob(os.path.join(run_dir, "**", "hparams.yml"), recursive=True)
        results = {
            "scalars": read_scalars(run_dir),
            "checks": {"hparams_file_written": len(hparams) == 1},
            "info": {"hparams_files": [os.path.relpath(p, run_dir) for p in hparams]},
        }
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
