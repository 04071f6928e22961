"""``save_state()`` without a folder: ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)`` numbers the checkpoints and keeps the 2 newest; ``load_state()`` without a
folder restores the newest. Both ranks must agree on each folder (a race once failed one
rank with "checkpoint_0 already exists").
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ_LEN = 64, 12


def parameter_norm(model):
    return sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()) ** 0.5


def main():
    parser = argparse.ArgumentParser(description="Numbered checkpoints, the 2 newest kept.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    project = ProjectConfiguration(
        project_dir=args.output_dir, automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(project_config=project)
    set_seed(31)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=16, n_layer=1, n_head=2)
    )
    gen = torch.Generator().manual_seed(32)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ_LEN,), generator=gen)} for _ in range(32)]
    loader = DataLoader(data, batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, saved_norms = [], []
    for _epoch in range(3):
        for batch in loader:
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        accelerator.save_state()
        saved_norms.append(parameter_norm(model))
    accelerator.wait_for_everyone()
    kept = sorted(os.listdir(os.path.join(args.output_dir, "checkpoints")))

    for parameter in model.parameters():  # spoil the weights, then restore the newest
        parameter.data.zero_()
    accelerator.load_state()
    if accelerator.is_main_process:
        results = {
            "losses": losses,
            "kept": kept,
            "saved_norms": saved_norms,
            "restored_norm": parameter_norm(model),
        }
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
