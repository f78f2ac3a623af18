"""The PyTorch side of `cargo bench -p hora-client --bench training`: the same MLP, data, batch
size, optimizer and per-batch bookkeeping (loss and correct count read back every batch, as
hora's trainer does), timed the same way. Prints `samples_per_sec <best of runs>`.

    python3 torch_mlp.py --samples N --batch B --epochs E --runs R --threads T
"""
import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    xs = torch.rand(a.samples, 784)
    ys = torch.randint(0, 10, (a.samples,))
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 200), torch.nn.ReLU(),
        torch.nn.Linear(200, 200), torch.nn.ReLU(),
        torch.nn.Linear(200, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def epoch() -> None:
        order = torch.randperm(a.samples)
        loss_sum, correct = 0.0, 0
        for start in range(0, a.samples, a.batch):
            idx = order[start:start + a.batch]
            x, y = xs.index_select(0, idx), ys.index_select(0, idx)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(-1) == y).sum().item())

    epoch()  # warm-up
    best = 0.0
    for _ in range(a.runs):
        t = time.perf_counter()
        for _ in range(a.epochs):
            epoch()
        best = max(best, a.samples * a.epochs / (time.perf_counter() - t))
    print(f"samples_per_sec {best:.1f}")


if __name__ == "__main__":
    main()
