"""Train a tiny, randomly initialised Hugging Face causal LM: a model nobody on this project wrote.

The model is built from its config (no weights are downloaded): `--model gpt2` is
GPT2LMHeadModel(GPT2Config(...)), `--model llama` is LlamaForCausalLM(LlamaConfig(...)), both
trained with AdamW on random token batches, the loss computed by the model itself (labels=).
Like tinygpt.py this is an ordinary training script: it never imports bitguard. Faults:

  mlp-bitflip  flip one bit of the first MLP projection's output in layer --fault-layer
               (gpt2: transformer.h.{L}.mlp.c_fc, a Conv1D; llama: model.layers.{L}.mlp.up_proj)
  rope-bf16    llama only: apply_rotary_pos_emb, a plain function called inside every
               LlamaAttention.forward between k_proj/v_proj and o_proj, rotates q and k with
               cos/sin rounded to bf16 (a low-precision functional op inside third-party code)

Every fault is active from --fault-step on.
"""

from __future__ import annotations

import argparse
import json

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-seed", dest="self_seed", action="store_false",
                   help="do not seed the global RNG (leave it to the launcher, as many training stacks do)")
    p.add_argument("--fault", choices=("mlp-bitflip", "rope-bf16"), default=None)
    p.add_argument("--fault-step", type=int, default=1)
    p.add_argument("--fault-layer", type=int, default=0)
    p.add_argument("--losses", default=None, help="write the per-step losses here (JSON)")
    return p.parse_args(argv)


def build_model(args) -> torch.nn.Module:
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                            n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                            attn_pdrop=args.dropout, use_cache=False,
                            bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                         attention_dropout=args.dropout, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def flip_bit(t: torch.Tensor, flat_index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    ints = out.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]).view(-1)
    ints[flat_index] ^= 1 << bit
    return out


def install_fault(args, model: torch.nn.Module, state: dict) -> None:
    active = lambda: state["step"] >= args.fault_step  # noqa: E731
    if args.fault == "mlp-bitflip":
        mlp = (model.transformer.h if args.model == "gpt2" else model.model.layers)[args.fault_layer].mlp
        proj = mlp.c_fc if args.model == "gpt2" else mlp.up_proj
        original = proj.forward
        proj.forward = lambda x: flip_bit(original(x), 5, 6) if active() else original(x)
    elif args.fault == "rope-bf16":
        if args.model != "llama":
            raise SystemExit("--fault rope-bf16 needs --model llama")
        from transformers.models.llama import modeling_llama

        exact = modeling_llama.apply_rotary_pos_emb

        def apply_rotary_pos_emb(q, k, cos, sin, *rest, **kw):
            if active():
                cos, sin = cos.to(torch.bfloat16).to(cos.dtype), sin.to(torch.bfloat16).to(sin.dtype)
            return exact(q, k, cos, sin, *rest, **kw)

        modeling_llama.apply_rotary_pos_emb = apply_rotary_pos_emb


def main(argv=None):
    args = parse_args(argv)
    if args.self_seed:
        torch.manual_seed(args.seed)
    model = build_model(args)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    state = {"step": 0}
    install_fault(args, model, state)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq),
                         generator=torch.Generator().manual_seed(args.seed + 1))
    losses = []
    for step in range(args.steps):
        state["step"] = step
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if args.losses:
        with open(args.losses, "w") as f:
            json.dump({"losses": losses}, f)
    return losses


if __name__ == "__main__":
    main()
