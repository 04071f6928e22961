"""Distributed inference, as in Accelerate's distributed-inference guide: through
``PartialState``, prompts split between processes with ``split_between_processes`` (7
prompts on 2 processes: uneven), greedy generation, results collected with
``gather_object``. Then the tensor tools: ``split_between_processes(..., apply_padding=True)``
on a dict of tensors, ``pad_across_processes``, ``gather`` and ``reduce``.
"""

import argparse
import json

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object, set_seed
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50


def main():
    parser = argparse.ArgumentParser(description="split_between_processes inference.")
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    # The process's view without the training machinery. (A bare PartialState() before any
    # Accelerator would run non-distributed on CPU: only AcceleratorState reads
    # ACCELERATE_USE_CPU. After one, it is the same shared state.)
    distributed_state = PartialState()
    set_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    model.to(distributed_state.device)
    model.eval()

    prompts = [[(7 * i + j) % VOCAB for j in range(3 + i % 3)] for i in range(7)]
    completions = []
    with distributed_state.split_between_processes(prompts) as my_prompts:
        for prompt in my_prompts:
            input_ids = torch.tensor([prompt], device=distributed_state.device)
            with torch.no_grad():
                output = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=5,
                    do_sample=False,
                    pad_token_id=0,
                )
            completions.append(
                {"rank": distributed_state.process_index, "tokens": output[0].tolist()}
            )
    gathered = gather_object(completions)

    features = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    batch = {"features": features, "ids": torch.arange(10)}
    with accelerator.split_between_processes(batch, apply_padding=True) as shard:
        local_rows = shard["ids"].tolist()
        scores = shard["features"].sum(dim=1)
    all_scores = accelerator.gather(scores)
    # Ragged per-process tensors: pad to the longest, then gather.
    ragged = torch.full((accelerator.process_index + 2, 2), float(accelerator.process_index + 1))
    padded = accelerator.pad_across_processes(ragged, dim=0, pad_index=-1.0)
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), "sum")

    results = {
        "completions": gathered,
        "local_rows_rank0": local_rows,
        "all_scores": all_scores.tolist(),
        "padded_gathered": accelerator.gather(padded).tolist(),
        "reduced_sum": total.tolist(),
        "checks": {
            "every_prompt_once_in_order": len(gathered) == len(prompts)
            and all(c["tokens"][: len(p)] == p for c, p in zip(gathered, prompts, strict=True))
        },
    }
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
