"""Checkpoint with ``save_state``, resume with ``load_state`` (and ``skip_first_batches``
mid-epoch): the resumed run equals the uninterrupted one (Accelerate's
by_feature/checkpointing.py, with the runs in one script).

Twice: with dropout, checkpointed at the end of the first epoch, so the resume is exact
only if the random states come back too; without dropout, checkpointed mid-epoch. (Mid-epoch
with dropout is not exact under Accelerate itself: a new DataLoader iterator draws its base
seed from the global generator, one draw more than the uninterrupted run made.)
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

VOCAB, SEQ_LEN = 96, 16
EPOCHS = 2


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


def training_function(args, model_seed, dropout, stop_at_step=None, resume_from_checkpoint=None):
    # A seedable sampler makes each epoch's order a function of (seed, epoch), so a resumed
    # run sees the same batches (Accelerate's default sampler order would start over).
    accelerator = Accelerator(
        project_dir=args.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(model_seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        num_labels=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    model = BertForSequenceClassification(config)
    set_seed(42)  # the data order and dropout: the same in every run
    train_dataloader = DataLoader(synthetic_reviews(48, seed=1), batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lr_scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=2, num_training_steps=24
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    starting_epoch, resume_step, overall_step = 0, None, 0
    if resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {resume_from_checkpoint}")
        accelerator.load_state(resume_from_checkpoint)
        overall_step = int(os.path.basename(resume_from_checkpoint).split("_")[1])
        starting_epoch, resume_step = divmod(overall_step, len(train_dataloader))

    losses = []
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        train_dataloader.set_epoch(epoch)
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            overall_step += 1
            if overall_step == stop_at_step:
                checkpoint = os.path.join(
                    args.output_dir, f"dropout{dropout}", f"step_{overall_step}"
                )
                accelerator.save_state(checkpoint)
                return accelerator, losses, checkpoint
    return accelerator, losses, parameter_summary(accelerator.unwrap_model(model))


def main():
    parser = argparse.ArgumentParser(description="save_state / load_state resume.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    results = {"checks": {}}
    for dropout, stop_at_step in ((0.1, 6), (0.0, 8)):
        _, losses, uninterrupted = training_function(args, 0, dropout)
        _, first_losses, checkpoint = training_function(args, 0, dropout, stop_at_step)
        # Fresh weights: load_state must overwrite them, not luck into the same values.
        accelerator, resumed_losses, resumed = training_function(
            args, 5, dropout, resume_from_checkpoint=checkpoint
        )
        case = f"dropout{dropout}_at_step{stop_at_step}"
        results[case] = {
            "losses": losses,
            "resumed_losses": first_losses + resumed_losses,
            "params": uninterrupted,
            "resumed_params": resumed,
        }
        results["checks"][f"{case}_resumed_losses_equal"] = first_losses + resumed_losses == losses
        results["checks"][f"{case}_resumed_params_equal"] = resumed == uninterrupted
    results["info"] = {"checkpoint_files": sorted(os.listdir(checkpoint))}
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
