"""The training function the Spark test runs on every barrier task: the MLP of
`hora-client sync`'s test, with the same data, batch, learning rate and momentum."""

import torch

import hora
import hora.sync as hs
from client_main import MLP
from sync_main import fit

DATA = "synthetic-iid:clients=1,seed=3,min_samples=4000,max_samples=4000"


def train(epochs: int, batch: int) -> float:
    hs.init()
    torch.manual_seed(1)
    torch.set_num_threads(1)
    (x, y), (tx, ty), _ = hora.load_dataset(DATA, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = MLP()
    # Initialised as the Rust client's built-in MLP is (tch's default for linear layers:
    # Kaiming-uniform weights for ReLU; PyTorch's default is three times narrower).
    for layer in (model.fc1, model.fc2):
        torch.nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
    fit(model, x, y, batch, epochs)
    with torch.no_grad():
        predicted = model(torch.from_numpy(tx)).argmax(1)
    return float((predicted == torch.from_numpy(ty)).float().mean())


def fail_on_rank_two() -> None:
    hs.init()
    if hs.rank() == 2:
        raise ValueError("this worker's data is unreadable")
    hs.barrier()
