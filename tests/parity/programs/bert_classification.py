"""Fine-tune a (tiny) BERT for sequence classification: Accelerate's nlp_example, offline.

AdamW, a linear schedule with warmup from ``transformers.get_scheduler``, two epochs over a
shuffled loader, accuracy on a held-out set through ``gather_for_metrics``.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

VOCAB, SEQ_LEN = 96, 16


def synthetic_reviews(size, seed):
    """Token sequences of varying length; label 1 when most real tokens are 'high' ids."""
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
    accelerator = Accelerator()
    set_seed(42)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    train_dataloader = DataLoader(synthetic_reviews(96, seed=1), batch_size=8, shuffle=True)
    eval_dataloader = DataLoader(synthetic_reviews(40, seed=2), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    num_epochs = 2
    lr_scheduler = get_scheduler(
        "linear",
        optimizer=optimizer,
        num_warmup_steps=2,
        num_training_steps=len(train_dataloader) * num_epochs,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    losses, learning_rates, accuracies, margins = [], [], [], []
    for _epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(outputs.loss.item())
            learning_rates.append(lr_scheduler.get_last_lr()[0])
        model.eval()
        correct = total = 0
        margin = 0.0
        for batch in eval_dataloader:
            with torch.no_grad():
                logits = model(**batch).logits
            logits, references = accelerator.gather_for_metrics((logits, batch["labels"]))
            correct += int((logits.argmax(dim=-1) == references).sum())
            total += len(references)
            margin += float((logits[:, 1] - logits[:, 0]).sum())
        accuracies.append(correct / total)
        margins.append(margin / total)
        accelerator.print(f"epoch {_epoch}: accuracy {accuracies[-1]:.3f}")

    results = {
        "losses": losses,
        "learning_rates": learning_rates,
        "eval_accuracy": accuracies,
        "eval_logit_margin": margins,
        "eval_samples": total,
        "params": parameter_summary(accelerator.unwrap_model(model)),
        "checks": {"every_eval_sample_counted_once": total == 40},
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description="Tiny BERT sequence classification.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
