"""bf16 mixed precision: ``Accelerator(mixed_precision="bf16")`` on a (tiny) GPT-2.

The model's forward runs under autocast once prepared; a label-smoothed loss computed
outside the model runs under ``with accelerator.autocast()``. Parameters stay float32.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, BLOCK = 64, 24


def counting_corpus(size, seed):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    return (start + stride * torch.arange(BLOCK)[None, :]) % VOCAB


def parameter_summary(model):
    params = [p.detach().double() for p in model.parameters()]
    return {
        "sum": sum(float(p.sum()) for p in params),
        "norm": sum(float(p.pow(2).sum()) for p in params) ** 0.5,
    }


def main():
    parser = argparse.ArgumentParser(description="bf16 autocast training.")
    parser.add_argument("--mixed_precision", default="bf16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    set_seed(99)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2)
    )
    loader = DataLoader(counting_corpus(48, seed=8), batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, logits_dtypes = [], set()
    model.train()
    for _epoch in range(2):
        for input_ids in loader:
            logits = model(input_ids=input_ids).logits
            logits_dtypes.add(str(logits.dtype))
            with accelerator.autocast():
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB),
                    input_ids[:, 1:].reshape(-1),
                    label_smoothing=0.1,
                )
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

    unwrapped = accelerator.unwrap_model(model)
    results = {
        "losses": losses,
        "logits_dtypes": sorted(logits_dtypes),
        "params": parameter_summary(unwrapped),
        "param_dtypes": sorted({str(p.dtype) for p in unwrapped.parameters()}),
        "mixed_precision": accelerator.mixed_precision,
        "checks": {
            "params_stay_float32": all(p.dtype == torch.float32 for p in unwrapped.parameters())
        },
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
