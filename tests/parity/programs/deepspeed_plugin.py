"""DeepSpeed through a plugin object: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(
zero_stage=2, ...))``, bf16, gradient accumulation and clipping set on the plugin (DeepSpeed
applies them inside its engine), then the consolidated state dict. CUDA only.
"""

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
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
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO-2 via DeepSpeedPlugin.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    deepspeed_plugin = DeepSpeedPlugin(
        zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0
    )
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=deepspeed_plugin)
    set_seed(23)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(synthetic_reviews(64, seed=24), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    state_dict = accelerator.get_state_dict(model)  # every rank calls it
    if accelerator.is_main_process:
        results = {
            "losses": losses,
            "state_dict_keys": len(state_dict),
            "state_dict_norm": sum(float(t.double().pow(2).sum()) for t in state_dict.values())
            ** 0.5,
            "info": {"distributed_type": str(accelerator.distributed_type)},
        }
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
