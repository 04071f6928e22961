"""Train a (tiny) GPT-2 as a causal language model: labels are the input ids.

The shape of transformers' ``run_clm_no_trainer.py``: AdamW with weight decay on all but
biases and LayerNorm weights, a cosine schedule, perplexity from the gathered eval losses.
"""

import argparse
import json
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

VOCAB, BLOCK = 64, 24


def counting_corpus(size, seed):
    """Sequences that count up with a random start and stride: learnable next tokens."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    ids = (start + stride * torch.arange(BLOCK)[None, :]) % VOCAB
    return [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(size)]


def parameter_summary(model):
    params = [p.detach().double() for p in model.parameters()]
    return {
        "sum": sum(float(p.sum()) for p in params),
        "norm": sum(float(p.pow(2).sum()) for p in params) ** 0.5,
    }


def main():
    parser = argparse.ArgumentParser(description="Tiny GPT-2 causal LM.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(1234)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2, n_inner=64
    )
    model = GPT2LMHeadModel(config)

    train_dataloader = DataLoader(
        counting_corpus(64, seed=3), shuffle=True, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        counting_corpus(16, seed=4), batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    grouped = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(grouped, lr=3e-3)
    max_train_steps = args.num_train_epochs * len(train_dataloader)
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=1,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    losses, perplexities = [], []
    for _epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        model.eval()
        eval_losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            eval_losses.append(
                accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size))
            )
        eval_loss = torch.mean(torch.cat(eval_losses))
        perplexities.append(math.exp(eval_loss))
        accelerator.print(f"epoch {_epoch}: perplexity {perplexities[-1]:.2f}")

    results = {
        "losses": losses,
        "perplexity": perplexities,
        "final_lr": lr_scheduler.get_last_lr()[0],
        "params": parameter_summary(accelerator.unwrap_model(model)),
        "checks": {"loss_went_down": losses[-1] < losses[0]},
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
