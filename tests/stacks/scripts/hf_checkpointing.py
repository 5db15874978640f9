"""A tiny Hugging Face Llama, built from its config (random weights, nothing downloaded), trained
for a few steps on CPU with `model.gradient_checkpointing_enable()`: transformers' own activation
checkpointing (torch.utils.checkpoint; non-reentrant unless `--reentrant`). An ordinary training
script: it never imports bitguard."""

import argparse

import torch
from _result import write_result
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reentrant", action="store_true", help="use_reentrant=True (transformers' default: False)")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(0, 64, (2, 16), generator=data)
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(model, losses)


if __name__ == "__main__":
    main()
