"""A callback of your own: named in the config by its dotted path, like an algorithm."""

from fl_lightning.callbacks import Callback


class StopAtAccuracy(Callback):
    """Stops the run once the global model's test accuracy reaches `target`, and records the
    round where it did."""

    def __init__(self, target: float = 0.95):
        self.target = target

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        accuracy = metrics.get("test_accuracy")  # on evaluation rounds; the same on every rank
        if accuracy is not None and accuracy >= self.target:
            metrics["reached_target_at"] = metrics["round"]  # saved and logged with the round's row
            loop.request_stop(f"test accuracy {accuracy:.4f} reached {self.target}")


class CountEvaluations(Callback):
    """Adds to each evaluation round's row how many evaluations the run has made so far: a count that
    must survive a resume, so it is the callback's state."""

    def __init__(self):
        self.evaluations = 0  # what the run built: state (arguments, if any, are configuration)

    def state_dict(self) -> dict:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.evaluations = state["evaluations"]

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if "test_accuracy" in metrics:
            self.evaluations += 1
            metrics["evaluations"] = self.evaluations
