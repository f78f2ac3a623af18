"""A Python federated client process for the tests: the MLP the Rust client builds, in
PyTorch, trained with hora.TorchTrainer on the same shard of the same data (and evaluating
published models on its held-out split when the task asks).

--must-not-train: fail if asked to train (a restarted client must resume its upload).
--hold FILE: after training, write FILE.trained and wait until FILE.go exists.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hora


class MLP(nn.Module):
    def __init__(self, inputs: int = 60, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--server", "--ca", "--state-dir", "--token", "--task", "--data"):
        p.add_argument(flag, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--rounds", type=int)
    p.add_argument("--label")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--must-not-train", action="store_true")
    p.add_argument("--hold")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (x, y), (tx, ty), _ = hora.load_dataset(args.data, args.index)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = DataLoader(data, batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    held_out = DataLoader(TensorDataset(torch.from_numpy(tx), torch.from_numpy(ty)), batch_size=256)
    trainer = hora.TorchTrainer(MLP(), loader, eval_loader=held_out)

    def train(weights, config):
        if args.must_not_train:
            raise AssertionError("asked to train again instead of resuming the saved update")
        result = trainer(weights, config)
        if args.hold:
            open(args.hold + ".trained", "w").close()
            while not os.path.exists(args.hold + ".go"):
                time.sleep(0.05)
        return result

    client = hora.Client(args.server, args.ca, args.state_dir, token=args.token, label=args.label)
    summary = client.run(args.task, train, rounds=args.rounds, evaluate_fn=trainer.evaluate_fn)
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
