"""Manual gradient accumulation with ``accelerator.no_sync(model)``, then an evaluation whose
last batch is uneven: 45 samples, batches of 4 on 2 processes. ``gather_for_metrics``
drops the samples the loader repeated to even out the ranks, so every sample counts once.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import DistilBertConfig, DistilBertForSequenceClassification

VOCAB, SEQ_LEN = 80, 12


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids < 20).sum(1) > (ids > 60).sum(1)).long()
    return [{"input_ids": ids[i], "labels": labels[i], "index": i} for i in range(size)]


def parameter_summary(model):
    params = [p.detach().double() for p in model.parameters()]
    return {
        "sum": sum(float(p.sum()) for p in params),
        "norm": sum(float(p.pow(2).sum()) for p in params) ** 0.5,
    }


def main():
    parser = argparse.ArgumentParser(description="no_sync accumulation, uneven evaluation.")
    parser.add_argument("--accumulation_steps", type=int, default=3)
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(21)
    model = DistilBertForSequenceClassification(
        DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=SEQ_LEN,
            num_labels=2,
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_dataloader = DataLoader(synthetic_reviews(72, seed=11), batch_size=6, shuffle=True)
    eval_dataloader = DataLoader(synthetic_reviews(45, seed=12), batch_size=4)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    losses = []
    model.train()
    for step, batch in enumerate(train_dataloader):
        batch.pop("index")
        if (step + 1) % args.accumulation_steps != 0:
            with accelerator.no_sync(model):
                loss = model(**batch).loss / args.accumulation_steps
                accelerator.backward(loss)
        else:
            loss = model(**batch).loss / args.accumulation_steps
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    model.eval()
    indices, predictions, sample_losses = [], [], []
    for batch in eval_dataloader:
        index = batch.pop("index")
        with torch.no_grad():
            logits = model(**batch).logits
        per_sample = F.cross_entropy(logits, batch["labels"], reduction="none")
        index, prediction, per_sample = accelerator.gather_for_metrics(
            (index, logits.argmax(-1), per_sample)
        )
        indices += index.tolist()
        predictions += prediction.tolist()
        sample_losses += per_sample.tolist()

    results = {
        "losses": losses,
        "eval_indices": indices,
        "eval_predictions": predictions,
        "eval_losses": sample_losses,
        "params": parameter_summary(accelerator.unwrap_model(model)),
        "checks": {"each_eval_sample_once": sorted(indices) == list(range(45))},
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
