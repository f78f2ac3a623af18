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


# -- elastic: hora.spark.run_elastic on ordinary tasks (spark_elastic_main.py drives it) --------

ELASTIC_DATA = "synthetic-iid:clients=1,seed=3,min_samples=400,max_samples=400"


def elastic_state():
    """Each task's state: the MLP and SGD with momentum, from the same seed."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MLP()
    return hs.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), step=0)


def elastic_train(state, steps: int) -> dict:
    """One global batch of 8 a rank a step; commits every 5 steps. Task 1's first attempt
    exits abruptly at step 12 of the first world (Spark retries it, and the retry joins at a
    commit); every world trains until one of three that formed after the loss has trained 10
    steps, and at least `steps`."""
    import os
    import time

    from pyspark import TaskContext

    from sync_main import digest

    ctx = TaskContext.get()
    (x, y), _, _ = hora.load_dataset(ELASTIC_DATA, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model, opt = state.model, state.optimizer
    dist = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    generation, start = hs._the_ring().generation, state.step
    while state.step < steps or (hs.size() < 3 or generation < 3) and state.step < 50 * steps or (
            generation >= 3 and state.step < start + 10):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(state.step))
        mine = order[hs.rank() * 8: (hs.rank() + 1) * 8]
        dist.zero_grad()
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        dist.step()
        state.step += 1
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0 and state.step == 12:
            os._exit(3)
        if state.step % 5 == 0:
            state.commit()
        time.sleep(0.01)
    return {"digest": digest(model, opt), "step": state.step, "task": ctx.partitionId(),
            "attempt": ctx.attemptNumber(), "generation": generation, "size": hs.size()}
