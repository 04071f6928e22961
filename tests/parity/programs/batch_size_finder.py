"""Find a batch size that fits (Accelerate's by_feature/memory.py): the training loop is
wrapped in ``find_executable_batch_size``, which shrinks the batch size after each
out-of-memory error (to 90 % in Accelerate 1.x). Memory is simulated: batches above 12
samples "run out of memory" with the message PyTorch's CPU allocator gives, on every
process alike.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

VOCAB, SEQ_LEN = 96, 16
MEMORY_LIMIT_SAMPLES = 12


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > SEQ_LEN).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(size)]


def main():
    parser = argparse.ArgumentParser(description="find_executable_batch_size.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    tried, losses = [], []

    @find_executable_batch_size(starting_batch_size=16)
    def inner_training_loop(batch_size):
        nonlocal accelerator  # the loop frees and rebuilds what it prepared
        accelerator.free_memory()
        tried.append(batch_size)
        losses.clear()
        set_seed(4)
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        loader = DataLoader(synthetic_reviews(96, seed=6), batch_size=batch_size, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        model.train()
        for batch in loader:
            if len(batch["input_ids"]) > MEMORY_LIMIT_SAMPLES:
                raise RuntimeError(
                    "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                    f"{len(batch['input_ids']) << 20} bytes."
                )
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return batch_size

    found = inner_training_loop()
    results = {
        "tried_batch_sizes": tried,
        "batch_size": found,
        "losses": losses,
        "checks": {
            "shrank_until_it_fit": tried[0] == 16
            and tried == sorted(tried, reverse=True)
            and found == tried[-1] <= MEMORY_LIMIT_SAMPLES < tried[-2]
        },
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
