"""Kwargs handlers: ``DistributedDataParallelKwargs(find_unused_parameters=True)`` for a
model whose BERT pooler never takes part in the loss (DDP fails at the second step without
it), ``InitProcessGroupKwargs(timeout=...)``, and ``GradScalerKwargs``, which configures
fp16 loss scaling and so changes nothing in this float32 run (``accelerator.scaler`` stays
None, as in Accelerate).
"""

import argparse
import json
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    set_seed,
)
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel

VOCAB, SEQ_LEN = 96, 16


class FirstTokenClassifier(torch.nn.Module):
    """Classifies from the first token's hidden state: BertModel's pooler goes unused."""

    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config)
        self.head = torch.nn.Linear(config.hidden_size, 2)

    def forward(self, input_ids, labels):
        hidden = self.bert(input_ids=input_ids).last_hidden_state[:, 0]
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits, labels)


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > SEQ_LEN).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(size)]


def main():
    parser = argparse.ArgumentParser(description="DDP, process-group and scaler kwargs.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    init_kwargs = InitProcessGroupKwargs(timeout=timedelta(seconds=600))
    scaler_kwargs = GradScalerKwargs(init_scale=1024.0, growth_interval=4)
    accelerator = Accelerator(kwargs_handlers=[ddp_kwargs, init_kwargs, scaler_kwargs])
    set_seed(31)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
    )
    model = FirstTokenClassifier(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(synthetic_reviews(64, seed=32), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    model.train()
    for batch in loader:
        loss = model(**batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    unwrapped = accelerator.unwrap_model(model)
    results = {
        "losses": losses,
        "pooler_unchanged_norm": float(unwrapped.bert.pooler.dense.weight.detach().double().norm()),
        "head_norm": float(unwrapped.head.weight.detach().double().norm()),
        "find_unused_parameters": getattr(model, "find_unused_parameters", None),
        "scaler_is_none": accelerator.scaler is None,
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
