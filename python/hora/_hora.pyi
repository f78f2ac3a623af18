"""Type stubs of the native module (see the Python wrappers for documentation)."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__version__: str

class HoraError(Exception): ...
class Refused(HoraError):
    code: str
class Unavailable(HoraError): ...
class TaskEnded(HoraError): ...
class SyncFailed(HoraError):
    rank: Optional[int]
    survivable: bool

class Client:
    def __init__(
        self,
        server: str,
        ca: str,
        state_dir: str,
        token: Optional[str] = ...,
        label: Optional[str] = ...,
        poll_wait_secs: float = ...,
        cert: Optional[str] = ...,
        key: Optional[str] = ...,
    ) -> None: ...
    @property
    def id(self) -> str: ...
    def run(
        self,
        task: str,
        train_fn: Callable[[Dict[str, np.ndarray], Dict[str, Any]], Tuple[Dict[str, np.ndarray], int, Any]],
        rounds: Optional[int] = ...,
        on_round: Optional[Callable[[Dict[str, Any]], None]] = ...,
        evaluate_fn: Optional[Callable[[Dict[str, np.ndarray], Dict[str, Any]], Tuple[int, Dict[str, Any]]]] = ...,
    ) -> Dict[str, Any]: ...

class AdminConnection:
    def __init__(
        self, url: str, ca: str, token: str, cert: Optional[str] = ..., key: Optional[str] = ...
    ) -> None: ...
    def request(self, method: str, path: str, json: Optional[str] = ...) -> bytes: ...
    def upload(self, path: str, data: bytes) -> bytes: ...

class Ring:
    @staticmethod
    def single() -> Ring: ...
    @staticmethod
    def from_peers(
        peers: List[str],
        rank: int,
        secret: Optional[str] = ...,
        timeout_secs: float = ...,
        half_precision: bool = ...,
        seal_frames: bool = ...,
    ) -> Ring: ...
    @staticmethod
    def from_server(
        server: str,
        ca: str,
        job: str,
        token: str,
        world_size: int,
        rank: Optional[int] = ...,
        listen: str = ...,
        advertise: Optional[str] = ...,
        timeout_secs: float = ...,
        half_precision: bool = ...,
        seal_frames: bool = ...,
        cert: Optional[str] = ...,
        key: Optional[str] = ...,
    ) -> Ring: ...
    @staticmethod
    def join_elastic(
        server: str,
        ca: str,
        job: str,
        token: str,
        max_world_size: int,
        rejoin: Optional[Tuple[int, int, int]] = ...,
        listen: str = ...,
        advertise: Optional[str] = ...,
        timeout_secs: float = ...,
        half_precision: bool = ...,
        seal_frames: bool = ...,
        cert: Optional[str] = ...,
        key: Optional[str] = ...,
    ) -> Ring: ...
    @property
    def rank(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def size(self) -> int: ...
    # copy=False runs on the array's own memory with the GIL released: only for an array that
    # no other thread can reach (one resized meanwhile would be freed under the ring).
    def allreduce(self, array: np.ndarray, average: bool = ..., name: str = ..., copy: bool = ...) -> None: ...
    def broadcast(self, array: np.ndarray, root: int = ..., name: str = ..., copy: bool = ...) -> None: ...
    def allreduce_fused(self, arrays: Sequence[np.ndarray], average: bool = ..., fusion_bytes: int = ..., name: str = ...) -> None: ...
    def broadcast_fused(self, arrays: Sequence[np.ndarray], root: int = ..., fusion_bytes: int = ..., name: str = ...) -> None: ...
    def allgather(self, data: bytes) -> List[bytes]: ...
    def use_nccl(self, device: int, required: bool = ...) -> Optional[str]: ...
    def release_nccl(self) -> None: ...
    def nccl_allreduce(
        self, buffers: Sequence[Tuple[int, int, str]], average: bool = ..., stream: int = ..., name: str = ...
    ) -> None: ...
    def nccl_broadcast(
        self, buffers: Sequence[Tuple[int, int, str]], root: int = ..., stream: int = ..., name: str = ...
    ) -> None: ...

class PendingRing:
    def __init__(self, listen: str = ..., advertise: Optional[str] = ...) -> None: ...
    @property
    def address(self) -> str: ...
    def connect(
        self,
        peers: List[str],
        rank: int,
        secret: str,
        timeout_secs: float = ...,
        half_precision: bool = ...,
        seal_frames: bool = ...,
    ) -> Ring: ...

def launch_rank(
    rank: Optional[int] = ..., size: Optional[int] = ...
) -> Tuple[Optional[int], Optional[int], Optional[int], str]: ...
def torchrun_peers() -> Optional[List[str]]: ...
def nccl_probe() -> Tuple[Optional[str], int, Optional[str]]: ...
def sync_job_finish(
    server: str,
    ca: str,
    job: str,
    token: str,
    timeout_secs: float = ...,
    cert: Optional[str] = ...,
    key: Optional[str] = ...,
) -> None: ...
def sync_job_status(
    server: str,
    ca: str,
    job: str,
    token: str,
    timeout_secs: float = ...,
    cert: Optional[str] = ...,
    key: Optional[str] = ...,
) -> Tuple[int, int]: ...
def encode_model(weights: Dict[str, np.ndarray]) -> bytes: ...
def decode_model(data: bytes) -> Dict[str, np.ndarray]: ...
def load_dataset(
    spec: str, client_index: Optional[int] = ..., holdout: float = ...
) -> Tuple[Tuple[np.ndarray, np.ndarray], Optional[Tuple[np.ndarray, np.ndarray]], int]: ...
def simulate(
    task: str,
    clients: int,
    worker_command: List[str],
    data: str,
    partition: Optional[str] = ...,
    seed: int = ...,
    workers: int = ...,
    profile: str = ...,
    evaluate_clients: int = ...,
    initial: Optional[Dict[str, np.ndarray]] = ...,
    on_row: Optional[Callable[[Dict[str, Any]], None]] = ...,
    checkpoint: Optional[str] = ...,
) -> Dict[str, Any]: ...
def claim_checkpoint(dir: str) -> None: ...
def simulate_worker(open: Callable[[Dict[str, Any]], Any], input_fd: int, output_fd: int) -> None: ...

class Plan:
    def indices(self, client: int) -> np.ndarray: ...
    def __len__(self) -> int: ...

def partition(partitioner: str, labels: np.ndarray, classes: int, clients: int, seed: int) -> Plan: ...
