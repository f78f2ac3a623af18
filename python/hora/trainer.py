""":class:`TorchTrainer`: a training function for :meth:`hora.Client.run` made of a PyTorch
module, a DataLoader and an optimizer."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np

from .client import TrainResult, load_state, to_numpy

log = logging.getLogger("hora")


class TorchTrainer:
    """Trains ``model`` on ``loader`` each round, as the task's settings say.

    Each call loads the round's global weights into ``model``, trains ``config["epochs"]``
    passes over ``loader`` (stopping early, with what it has, when the round's deadline nears),
    and returns the trained ``state_dict``, the number of examples seen per epoch and the mean
    loss and accuracy of the last epoch.

    Args:
        model: the module; its ``state_dict`` names must match the task's model.
        loader: yields ``(inputs, targets)`` batches (a ``torch.utils.data.DataLoader``).
        optimizer: a factory ``params -> torch.optim.Optimizer``, or None to build what the task
            says each round (SGD with the task's momentum, or Adam, at its learning rate).
        loss_fn: defaults to cross-entropy.
        device: where to train (``"cpu"``, ``"cuda"``, …).
        eval_loader: held-out ``(inputs, targets)`` batches: with them the trainer answers the
            task's federated evaluation (:attr:`evaluate_fn`, which :meth:`hora.Client.run`
            takes by default); without, the client declines to evaluate.

    Each epoch logs a line (loss, accuracy, samples, seconds) to the ``hora`` logger at INFO.

    With ``proximal_mu > 0`` in the task's settings it adds FedProx's proximal term
    ``μ/2·‖w − w_global‖²``. For a task that trains part of its model (``config["trainable"]``)
    it freezes the other parameters and returns the trainable tensors only.
    """

    def __init__(
        self,
        model: Any,
        loader: Iterable[Tuple[Any, Any]],
        optimizer: Optional[Callable[[Any], Any]] = None,
        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
        device: Any = "cpu",
        eval_loader: Optional[Iterable[Tuple[Any, Any]]] = None,
    ) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.loader = loader
        self.optimizer = optimizer
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        # Which parameters may learn at all (a peft model's base may not): a task that trains
        # part of its model freezes more of them for its rounds, and only for those.
        self._learns = {name: p.requires_grad for name, p in self.model.named_parameters()}
        self.eval_loader = eval_loader

    @property
    def evaluate_fn(self) -> Optional[Callable[[Dict[str, np.ndarray], Dict[str, Any]], Tuple[int, Dict[str, float]]]]:
        """The federated-evaluation function of this trainer (None without ``eval_loader``):
        loads a published model and evaluates it on ``eval_loader``."""
        if self.eval_loader is None:
            return None
        loader = self.eval_loader

        def evaluate(weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> Tuple[int, Dict[str, float]]:
            self.load(weights)
            result = self.evaluate(loader)
            log.info("evaluated round %s's model · loss %.4f · accuracy %.4f · %d samples",
                     config.get("round"), result["loss"], result["accuracy"], result["examples"])
            return int(result["examples"]), {"loss": result["loss"], "accuracy": result["accuracy"]}

        return evaluate

    def load(self, weights: Mapping[str, np.ndarray]) -> None:
        """Loads global weights (float32 arrays by name) into the model, keeping its dtypes."""
        load_state(self.model, weights, "the task's model")

    def _optimizer(self, config: Mapping[str, Any]) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is not None:
            return self.optimizer(params)
        lr = float(config.get("learning_rate", 0.01))
        choice = config.get("optimizer") or {"name": "sgd"}
        if choice.get("name") == "adam":
            return self.torch.optim.Adam(params, lr=lr)
        return self.torch.optim.SGD(params, lr=lr, momentum=float(choice.get("momentum", 0.0)))

    def __call__(self, weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> TrainResult:
        torch = self.torch
        self.load(weights)
        # A task that trains part of its model: the rest (its frozen base) gets no gradients,
        # and only the trainable tensors go back.
        trainable = config.get("trainable")
        keep = None if trainable is None else set(trainable)
        for name, p in self.model.named_parameters():
            p.requires_grad_(self._learns.get(name, True) and (keep is None or name in keep))
        optimizer = self._optimizer(config)
        mu = float(config.get("proximal_mu", 0.0))
        anchor = [p.detach().clone() for p in self.model.parameters()] if mu > 0 else []
        seconds = config.get("seconds_left")
        deadline = None if seconds is None else time.monotonic() + float(seconds)
        epochs = int(config.get("epochs", 1))
        self.model.train()
        seen = loss_sum = correct = 0.0
        for epoch in range(epochs):
            started = time.monotonic()
            seen = loss_sum = correct = 0.0
            for inputs, targets in self.loader:
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                optimizer.zero_grad()
                outputs = self.model(inputs)
                loss = self.loss_fn(outputs, targets)
                if mu > 0:
                    prox = sum(((p - a) ** 2).sum() for p, a in zip(self.model.parameters(), anchor))
                    loss = loss + mu / 2 * prox
                loss.backward()
                optimizer.step()
                n = len(targets)
                seen += n
                loss_sum += float(loss.detach()) * n
                if outputs.dim() == 2:
                    correct += float((outputs.argmax(1) == targets).sum())
                if deadline is not None and time.monotonic() > deadline:
                    break
            log.info(
                "round %s epoch %d/%d · loss %.4f · accuracy %.4f · %d samples · %.1f s",
                config.get("round"), epoch + 1, epochs, loss_sum / max(seen, 1),
                correct / max(seen, 1), seen, time.monotonic() - started,
            )
            if deadline is not None and time.monotonic() > deadline:
                log.warning("round %s: stopped at the deadline after %d of %d epochs",
                            config.get("round"), epoch + 1, epochs)
                break
        metrics = {
            "loss": loss_sum / seen if seen else math.nan,
            "accuracy": correct / seen if seen else None,
        }
        if not math.isfinite(metrics["loss"]):
            metrics["loss"] = None
        state = self.model.state_dict()
        if keep is not None:
            state = {k: v for k, v in state.items() if k in keep}
        return to_numpy(state), int(seen), metrics

    def evaluate(self, loader: Iterable[Tuple[Any, Any]]) -> Dict[str, float]:
        """Mean loss and accuracy of the model on ``loader``, and its number of ``examples``."""
        torch = self.torch
        self.model.eval()
        seen = loss_sum = correct = 0.0
        with torch.no_grad():
            for inputs, targets in loader:
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                outputs = self.model(inputs)
                loss_sum += float(self.loss_fn(outputs, targets)) * len(targets)
                correct += float((outputs.argmax(1) == targets).sum())
                seen += len(targets)
        return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1),
                "examples": seen}
