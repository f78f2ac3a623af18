"""A Python federated client process for the LoRA test: fine-tunes the adapter of
lora_model's transformer on its own synthetic text with hora.TorchTrainer."""

import argparse
import json
import sys

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hora
from lora_model import VOCAB, adapted, batches


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--server", "--ca", "--state-dir", "--token", "--task"):
        p.add_argument(flag, required=True)
    p.add_argument("--index", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y = batches(client=args.index, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(args.index))

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))

    # The same base as the server's task: the round's weights replace it anyway.
    trainer = hora.TorchTrainer(adapted(), loader, loss_fn=loss)
    client = hora.Client(args.server, args.ca, args.state_dir, token=args.token)
    print("SUMMARY " + json.dumps(client.run(args.task, trainer)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
