"""A tiny Hugging Face Llama, built from its config (random weights, nothing downloaded), trained
for 4 steps on CPU by the Hugging Face `Trainer` (which runs through accelerate). An ordinary
training script: it never imports bitguard. The losses are the Trainer's own, from its log
history (logged every step). STACK_FAULT=module:step=S flips a bit of model.layers.1.mlp's
output at the Trainer's step S."""

import argparse
import tempfile

import torch
from _fault import Fault
from _result import write_result
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset):
    """Random token rows, fixed by their own generator: the same in every run."""

    def __init__(self, rows=16, length=16, vocab=64):
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepOfFault(TrainerCallback):
    """Tells the fault the Trainer's step as it begins."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def on_step_begin(self, args, state, control, **kwargs):
        self.fault.step = state.global_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    args = ap.parse_args()
    set_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    fault = Fault(model.model.layers[1].mlp)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=2,
            gradient_accumulation_steps=args.accumulate, learning_rate=1e-3, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
            disable_tqdm=True)
        trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[StepOfFault(fault)])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == args.steps, trainer.state.log_history
    write_result(model, losses)


if __name__ == "__main__":
    main()
