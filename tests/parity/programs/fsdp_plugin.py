"""FSDP through a plugin object: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))``
(FSDP2, one unit per transformer block), then the full state dict on the main process.

Hugging Face Accelerate ignores an FSDP plugin on CPU (``MULTI_CPU`` never becomes
``FSDP``), so there this runs as plain DDP; the numbers must still agree with a sharded run
to rounding, which is what the comparison allows.
"""

import argparse
import json

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
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
    parser = argparse.ArgumentParser(description="FSDP2 via FullyShardedDataParallelPlugin.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
        state_dict_type="FULL_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=fsdp_plugin)
    set_seed(17)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ_LEN,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    loader = DataLoader(synthetic_reviews(64, seed=18), batch_size=4, shuffle=True)
    model = accelerator.prepare(model)
    # After prepare: FSDP replaces the parameters, and the optimizer must hold the new ones.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer, loader = accelerator.prepare(optimizer, loader)

    losses = []
    model.train()
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    model.eval()
    probe = torch.stack([row["input_ids"] for row in synthetic_reviews(8, seed=19)])
    with torch.no_grad():
        logits = model(input_ids=probe.to(accelerator.device)).logits
    state_dict = accelerator.get_state_dict(model)  # every rank calls it; full on rank 0
    if accelerator.is_main_process:
        results = {
            "losses": losses,
            "eval_logits": logits.float().cpu().tolist(),
            "state_dict_keys": len(state_dict),
            "state_dict_norm": sum(float(t.double().pow(2).sum()) for t in state_dict.values())
            ** 0.5,
            "info": {"distributed_type": str(accelerator.distributed_type)},
        }
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
