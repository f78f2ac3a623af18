"""Writes the TorchScript module the `torchscript` example trains federated.

    python3 examples/support/make_torchscript.py OUT.pt [--inputs 60] [--classes 10]

Any `torch.jit.script`-ed module whose forward maps a float batch [N, inputs] to logits
[N, classes] works; its parameters are what the federation trains (no Python on the clients).
"""
import argparse

import torch


class Net(torch.nn.Module):
    def __init__(self, inputs: int, hidden: int, classes: int):
        super().__init__()
        self.hidden = torch.nn.Linear(inputs, hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x.flatten(1))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--inputs", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.jit.script(Net(args.inputs, args.hidden, args.classes)).save(args.out)


if __name__ == "__main__":
    main()
