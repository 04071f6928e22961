"""FSDP with ``state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=False)``:
after training, every rank holds the whole state dict and may use it (here: its norm, which
the ranks compare through ``gather_object``).

Hugging Face Accelerate ignores an FSDP plugin on CPU and runs DDP, where every rank holds
the whole model; nbaccel shards, then gathers the weights to every rank.
"""

import argparse
import json

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import gather_object, set_seed
from torch.distributed.fsdp import FullStateDictConfig
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

VOCAB, SEQ_LEN = 96, 16


def synthetic_reviews(size, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > SEQ_LEN).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(size)]


def main():
    parser = argparse.ArgumentParser(description="A full state dict on every rank.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
        state_dict_type="FULL_STATE_DICT",
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
    )
    accelerator = Accelerator(fsdp_plugin=fsdp_plugin)
    set_seed(29)
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
    loader = DataLoader(synthetic_reviews(32, seed=30), batch_size=4, shuffle=True)
    model = accelerator.prepare(model)
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

    state_dict = accelerator.get_state_dict(model)  # every rank calls it, every rank gets it
    mine = {
        "rank": accelerator.process_index,
        "keys": len(state_dict),
        "on_cpu": all(t.device.type == "cpu" for t in state_dict.values()),
        "norm": sum(float(t.double().pow(2).sum()) for t in state_dict.values()) ** 0.5,
    }
    every_rank = gather_object([mine])
    assert [seen["rank"] for seen in every_rank] == list(range(accelerator.num_processes))
    # One process (one GPU) is not sharded: neither Accelerate nor nbaccel offloads then.
    offloaded = accelerator.num_processes == 1 or all(seen["on_cpu"] for seen in every_rank)
    assert all(seen["keys"] == mine["keys"] > 0 for seen in every_rank) and offloaded
    assert len({seen["norm"] for seen in every_rank}) == 1, every_rank  # the same weights
    if accelerator.is_main_process:
        results = {
            "losses": losses,
            "state_dict_keys": mine["keys"],
            "state_dict_norm": mine["norm"],
            "info": {"distributed_type": str(accelerator.distributed_type)},
        }
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
