"""The rank's trainer (`fl_lightning.federation.trainer`): every client's sample indices kept in the
partition's arrays (ClientSamples, or a list of arrays made one), a client's tensor made when it trains."""

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import FederationArgs
from fl_lightning.data import ClientSamples
from fl_lightning.federation.global_state import FlatGlobalModel
from fl_lightning.federation.setup import RunSettings
from fl_lightning.federation.trainer import LocalTrainer, TrainingData
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerSGD

PARTS = [np.array([11, 3, 7]), np.array([0, 1, 2, 4, 5]), np.array([9]), np.array([6, 8, 10])]


def trainer_of(partition) -> LocalTrainer:
    torch.manual_seed(0)
    module = ClassificationModule(nn.Linear(2, 3), 3)
    inputs, labels = torch.randn(12, 2), torch.randint(0, 3, (12,))
    federation = FederationArgs(num_clients=len(PARTS), clients_per_round=2, local_epochs=2, local_steps=None,
                                batch_size=2)
    return LocalTrainer(Fabric(accelerator="cpu", devices=1), module, TrainingData(inputs, labels, None),
                        FlatGlobalModel.bind(module, torch.device("cpu")), partition,
                        RunSettings(FedAvg(), federation=federation))


@pytest.mark.parametrize("given", ["lists", "client samples"])
def test_each_clients_indices_come_from_the_partitions_arrays(given):
    trainer = trainer_of(PARTS if given == "lists" else ClientSamples.of(PARTS))
    assert trainer.samples.indices.dtype == np.int32  # the partition's arrays, no tensor a client kept
    for client, part in enumerate(PARTS):
        samples = trainer.client_samples(client)
        assert samples.dtype == torch.long and samples.tolist() == part.tolist()
        # E x ceil(n_i / B) planned steps, none cut (no stragglers).
        assert trainer.steps_done(client, 0) == 2 * -(-len(part) // 2)
    assert trainer.training_pool().tolist() == list(range(12))


def test_a_clients_round_draws_its_batches_from_its_own_samples():
    trainer = trainer_of(PARTS)
    model = trainer.global_model
    server = FedAvg().setup(ServerSGD(), model.params.numel(), len(PARTS), model.params.device)
    for client, part in enumerate(PARTS):
        client_round = trainer.client_round(client, 0, {}, server)
        execution = client_round.execution
        assert client_round.num_samples == len(part) and execution.sample_indices.tolist() == part.tolist()
        drawn = torch.cat([execution.sample_indices[positions] for positions in execution.positions])
        assert sorted(drawn.tolist()) == sorted(part.tolist() * 2)  # two epochs over the client's samples
