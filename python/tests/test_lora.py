"""Federated fine-tuning of part of a model from Python: four clients train a LoRA adapter
(peft) of a small transformer on their own synthetic text; the task's frozen base never
changes, is downloaded once by each client, and the adapter learns the language."""

from __future__ import annotations

import sys

import numpy as np

from conftest import HERE, log
from lora_model import TRAINABLE, adapted, entropy, held_out_loss

ROUNDS = 4
MODEL_DOWNLOADS = 'hora_http_requests_total{route="/v1/tasks/{task}/model",method="GET",status="200"}'


def test_four_clients_fine_tune_a_lora_adapter_of_a_small_transformer(server, procs):
    model = adapted()
    state = model.state_dict()
    before = held_out_loss(model)
    info = server.admin.create_task(
        "lora", state, rounds=ROUNDS, target_clients=4, round_deadline_secs=120,
        trainable=TRAINABLE,
        training={"epochs": 2, "batch_size": 16, "learning_rate": 0.003,
                  "optimizer": {"name": "adam"}},
    )
    adapter = {name for name in state if "lora_" in name}
    assert len(adapter) == 12 and sum(state[n].numel() for n in adapter) < 0.02 * sum(
        v.numel() for v in state.values())
    # The task's model is the adapter; the rest is its frozen base.
    assert {t["name"] for t in info["spec"]} == adapter
    assert {t["name"] for t in info["frozen_base"]["spec"]} == set(state) - adapter

    for k in range(4):
        procs.start(f"lora-{k}", [
            sys.executable, str(HERE / "lora_main.py"), "--server", server.url,
            "--ca", str(server.ca), "--state-dir", str(procs.dir / f"lora-{k}"),
            "--token", server.enrol(), "--task", "lora", "--index", str(k),
        ])
    server.wait_finished("lora")
    procs.wait_all()
    for p in procs.procs:
        assert p.returncode == 0, log(p)
    assert [len(r["participants"]) for r in server.admin.rounds("lora")] == [4] * ROUNDS

    # The base is as uploaded; every round's model is the adapter only.
    for name, values in server.admin.base("lora").items():
        np.testing.assert_array_equal(values, state[name].numpy(), err_msg=name)
    assert set(server.admin.round_model("lora", ROUNDS)) == adapter
    # Each client downloaded the base once and a model per round.
    downloads = [line for line in server.admin.metrics().splitlines()
                 if line.startswith(MODEL_DOWNLOADS)]
    assert [float(line.rsplit(" ", 1)[1]) for line in downloads] == [4 * (ROUNDS + 1)]

    # The federated adapter learnt the language: held-out loss well down from the start,
    # towards the language's entropy.
    final = adapted()
    server.admin.load_round_model(final, "lora", ROUNDS)
    after = held_out_loss(final)
    print(f"held-out loss {before:.3f} -> {after:.3f} (entropy {entropy():.3f})")
    assert after < before - 0.25, (before, after)


def test_torch_trainer_trains_what_each_round_says_and_returns_only_that():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import hora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # frozen by the user: stays so
    data = TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))
    trainer = hora.TorchTrainer(model, DataLoader(data, batch_size=8))
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    config = {"epochs": 1, "learning_rate": 0.5}

    part, _, _ = trainer(weights, {**config, "trainable": ["1.weight", "1.bias"]})
    assert set(part) == {"1.weight", "1.bias"}
    assert not np.array_equal(part["1.weight"], weights["1.weight"])
    assert np.array_equal(model.state_dict()["0.weight"].numpy(), weights["0.weight"])

    # A round of a task that trains everything trains everything the user did not freeze.
    whole, _, _ = trainer(weights, config)
    assert set(whole) == set(weights)
    assert not np.array_equal(whole["0.weight"], weights["0.weight"])
    assert np.array_equal(whole["0.bias"], weights["0.bias"])
