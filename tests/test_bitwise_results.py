"""Final global models of fixed configs, bitwise, against digests recorded from an earlier version.

A refactor must not change what a run computes: each case trains a small federation in-process and
compares a SHA-256 of its final model (every parameter and buffer, by its bytes) with the digest
recorded before the code was restructured. A change that alters a result on purpose (a new default,
a fixed bug) records the new digests in the same commit and says why; `python
tests/test_bitwise_results.py` prints them. The digests hold for this CPU build of torch (CI's):
another torch release or CPU may round differently.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import CTPFL, MOON, SCAFFOLD, FedAvg, FedDyn, FedSAM
from fl_lightning.config import (
    CheckpointArgs,
    ClientOptimizerArgs,
    ComputeArgs,
    DataArgs,
    FabricArgs,
    FederationArgs,
    LoggerArgs,
    ModelArgs,
)
from fl_lightning.constraints import CONST
from fl_lightning.fit import fit

DATA = DataArgs(name="digits", partition="dirichlet", alpha=0.5, min_samples=20, augment=False)
FEDERATION = FederationArgs(rounds=3, num_clients=6, clients_per_round=4, local_steps=4, batch_size=16, eval_every=3)
MLP = ModelArgs(name="mlp", options={"hidden": 32, "depth": 1})
CONST_MLP = ModelArgs(name="mlp", bias=False, norm="none", options={"hidden": 32, "depth": 1})

CASES = {
    "fedavg": dict(algorithm=FedAvg(), model=MLP),
    "scaffold": dict(algorithm=SCAFFOLD(), model=MLP),
    "ctpfl_fused": dict(algorithm=CTPFL(span=0.2), model=MLP, compute=ComputeArgs(client_path="grouped")),
    "ctpfl_loop": dict(algorithm=CTPFL(span=0.2), model=MLP, compute=ComputeArgs(client_path="loop")),
    "moon": dict(algorithm=MOON(mu=1.0, projection_dim=8), model=MLP),
    "fedsam_const": dict(algorithm=FedSAM(rho=0.05), model=CONST_MLP, constraint=CONST()),
    "feddyn": dict(algorithm=FedDyn(alpha=0.1), model=MLP),
}

RECORDED = {
    "ctpfl_fused": "5d441e1f3154d479c619509cf7f094b127b615dd2f910eb350309f89827d8ba5",
    "ctpfl_loop": "81a886182ac26b0938689438e1987553401c2a8274266dcbfeede67f98b7fbc0",
    "fedavg": "e9ae4a6583011579ec51470bdbda20c83d6a3aca791f0aad093d4098ee7b4d89",
    "feddyn": "21c3841b6f28de957e10e89eda8975c737b3e7ad1342de85e977f32284769bde",
    "fedsam_const": "661beaccaf69fe4620e389ead33dabff14d64fd31ed8aa4a76e4ec2aaf554a1b",
    "moon": "378367f8efa1e85f12eb833825c519a31be355f8825cf13a24303e4aac8ab4f4",
    "scaffold": "903b4e2b502a8561beff62504a96b52a979f3e1be48a7fa377ebecf93a8a8d7e",
}


def final_model_digest(out_dir: Path, case: str) -> str:
    settings = CASES[case]
    # One intra-op thread: how a kernel splits its sums over threads can change the last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(out_dir, settings)
    finally:
        torch.set_num_threads(threads)
    state = torch.load(out_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["model"]
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(out_dir: Path, settings: dict) -> None:
    fit(
        algorithm=settings["algorithm"], model=settings["model"], data=DATA, federation=FEDERATION,
        client_optimizer=ClientOptimizerArgs(lr=0.05, momentum=0.9), constraint=settings.get("constraint"),
        fabric=FabricArgs(accelerator="cpu", devices=1),
        compute=settings.get("compute", ComputeArgs(client_path="loop")),
        logger=LoggerArgs(wandb_mode="disabled", progress_bar=False), checkpoint=CheckpointArgs(every=3),
        seed=0, out_dir=out_dir, resume=None,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_final_model_is_bitwise_the_recorded_one(case, tmp_path):
    assert final_model_digest(tmp_path / case, case) == RECORDED[case]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for name in sys.argv[1:] or sorted(CASES):
            print(f'    "{name}": "{final_model_digest(Path(folder) / name, name)}",', flush=True)
