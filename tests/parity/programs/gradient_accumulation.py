"""Gradient accumulation the Accelerate way (its by_feature/gradient_accumulation.py).

``Accelerator(gradient_accumulation_steps=4)`` and ``with accelerator.accumulate(model)``;
gradients are clipped with ``accelerator.clip_grad_norm_`` on the steps that synchronise.
10 batches per process and epoch: steps sync after batches 4 and 8, and at the end of the
loader (batch 10), as Accelerate does.
"""

import argparse
import json
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

VOCAB, SEQ_LEN = 96, 16


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (size,), generator=gen)
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = (((ids >= VOCAB // 2) & mask.bool()).sum(1) * 2 > lengths).long()
    return [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(size)
    ]


def parameter_summary(model):
    params = [p.detach().double() for p in model.parameters()]
    return {
        "sum": sum(float(p.sum()) for p in params),
        "norm": sum(float(p.pow(2).sum()) for p in params) ** 0.5,
    }


def training_function(args):
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(7)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        num_labels=2,
        hidden_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    train_dataloader = DataLoader(synthetic_reviews(80, seed=5), batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3)
    num_epochs = 2
    lr_scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=12
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    losses, grad_norms, synced, learning_rates = [], [], [], []
    for _epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
                    grad_norms.append(float(norm))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            synced.append(accelerator.sync_gradients)
            losses.append(loss.item())
            learning_rates.append(lr_scheduler.get_last_lr()[0])

    results = {
        "losses": losses,
        "grad_norms": grad_norms,
        "synced": synced,
        "learning_rates": learning_rates,
        "params": parameter_summary(accelerator.unwrap_model(model)),
        # 80 samples in batches of 4 split over the ranks, an optimizer step every
        # gradient_accumulation_steps batches and at each epoch's end (2 ranks: 6 in all).
        "checks": {
            "optimizer_steps": len(grad_norms)
            == num_epochs * math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        },
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description="Gradient accumulation with clipping.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
