"""Train, then save the way the transformers examples do::

    unwrapped_model.save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save,
                                    state_dict=accelerator.get_state_dict(model))

and load it back with ``from_pretrained`` on every process: the reloaded model gives the
trained model's logits. The optimizer state goes through ``accelerator.save`` too.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

VOCAB, SEQ_LEN = 96, 16


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > SEQ_LEN).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(size)]


def main():
    parser = argparse.ArgumentParser(description="save_pretrained + from_pretrained.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(3)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    loader = DataLoader(synthetic_reviews(64, seed=9), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    accelerator.save(optimizer.state_dict(), os.path.join(args.output_dir, "optimizer.pt"))
    accelerator.wait_for_everyone()

    probe = torch.stack([row["input_ids"] for row in synthetic_reviews(6, seed=10)])
    unwrapped_model.eval()
    # On the trained model's device: a GPU's logits equal a GPU's, not a CPU's, bit for bit.
    reloaded = BertForSequenceClassification.from_pretrained(args.output_dir).to(accelerator.device)
    reloaded.eval()
    with torch.no_grad():
        trained_logits = unwrapped_model(input_ids=probe.to(accelerator.device)).logits.cpu()
        reloaded_logits = reloaded(input_ids=probe.to(accelerator.device)).logits.cpu()
    optimizer_state = torch.load(os.path.join(args.output_dir, "optimizer.pt"))

    results = {
        "losses": losses,
        "logits": trained_logits.tolist(),
        "reloaded_logits": reloaded_logits.tolist(),
        "optimizer_steps_saved": [float(s["step"]) for s in optimizer_state["state"].values()][:3],
        "checks": {
            "reloaded_equals_trained": torch.equal(trained_logits, reloaded_logits),
            "saved_optimizer_has_state": len(optimizer_state["state"]) > 0,
        },
        "info": {"files": sorted(os.listdir(args.output_dir))},
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
