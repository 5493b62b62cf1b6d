"""Driver side of the trainer: one `TrainerWorker` Ray actor per rank (TP x PP x CP x DP), wired to one
torch.distributed group, behind blocking methods the controller and the weight bridge call. Assumes `ray.init` was
done."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from glue.trainer.config import TrainerConfig
from glue.trainer.worker import TrainerWorker
from glue.types import TrainBatch

if TYPE_CHECKING:  # the driver side stays free of the loss package's torch math
    from loss import LossConfig, SftLossConfig


class TrainerGroup:
    """The trainer as the loop sees it: `train_step`, `compute_logprobs`, `version` (+1 per train_step), and the
    weight-source calls."""

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig | SftLossConfig,
                 actor_options: Sequence[dict[str, Any]] | None = None, keep_versions: int = 1,
                 placement_timeout_s: float = 300.0):
        """`actor_options[rank]`: Ray options placing that rank (placement-group bundle, GPUs; see
        launch.run.cluster); by default each rank just reserves `cfg.num_cpus_per_worker` CPUs. `keep_versions`: policy
        versions each rank keeps on the host for `trainer.old_logprobs: snapshot` (sync.max_staleness + 1).
        `placement_timeout_s`: how long the ranks' processes may take to start on their bundles (a bundle whose node
        is gone may never come back) before the start fails, naming the ranks that have none."""
        if actor_options is not None and len(actor_options) != cfg.world_size:
            raise ValueError(f"TrainerGroup: {len(actor_options)} actor_options for {cfg.world_size} ranks")
        self.cfg = cfg
        self._start = dict(model_path=model_path, loss_cfg=loss_cfg, actor_options=actor_options,
                           keep_versions=keep_versions)  # what `restart` starts the ranks with again
        self.placement_timeout_s = placement_timeout_s
        self._start_ranks(**self._start)

    def _start_ranks(self, model_path: str, loss_cfg: LossConfig | SftLossConfig,
                     actor_options: Sequence[dict[str, Any]] | None, keep_versions: int) -> None:
        import ray

        cfg = self.cfg
        self.version = 0
        self._members: dict[int, tuple[int, ...]] = {}  # parallel source rank -> the ranks producing its tensors
        self._channel_members: dict[str, tuple[int, tuple[int, ...]]] = {}  # a parallel channel -> (source, members)
        actor_cls = ray.remote(TrainerWorker)
        self._actors = [
            actor_cls.options(**(actor_options[rank] if actor_options else {"num_cpus": cfg.num_cpus_per_worker}))
            .remote(model_path=model_path, cfg=cfg, loss_cfg=loss_cfg, rank=rank, world_size=cfg.world_size,
                    keep_versions=keep_versions)
            for rank in range(cfg.world_size)
        ]
        self._wait_for_placement()
        try:
            address, port = ray.get(self._actors[0].rendezvous_address.remote())
            lines = ray.get([a.initialize.remote(address, cfg.master_port or port) for a in self._actors])
            self.startup_line = lines[0]  # the actors' own output does not reach the driver (log_to_driver=False)
            print(self.startup_line, flush=True)
        except BaseException:
            self.shutdown()  # do not leave half-started actors holding CPUs
            raise

    def _wait_for_placement(self) -> None:
        import ray

        probes = [actor.__ray_ready__.remote() for actor in self._actors]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=self.placement_timeout_s)
        if len(ready) < len(probes):
            missing = [rank for rank, probe in enumerate(probes) if probe not in ready]
            actors, self._actors = self._actors, []
            for actor in actors:  # not shut down: the ones still waiting for a bundle would never answer
                ray.kill(actor)
            raise RuntimeError(f"trainer ranks {missing} did not start on their placement-group bundles within "
                               f"{self.placement_timeout_s:g} s (is their node gone?)")

    def restart(self) -> None:
        """Kill every rank (by handle: the survivors may be stuck in a collective with a dead one) and start them
        again with the options they had, so each takes its own placement-group bundle back; the new ranks hold the
        initial model at version 0 and no weight channel (`load_checkpoint` brings them to a checkpoint)."""
        import ray

        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor)
        self._start_ranks(**self._start)

    def dead_ranks(self, timeout_s: float = 10.0) -> dict[int, str]:
        """The ranks whose actor is gone, each with Ray's reason in one line (`death_line`). A rank busy in a call
        (or stuck in a collective with a dead peer) is alive: it is not waited for beyond `timeout_s`."""
        import ray
        from ray.exceptions import RayActorError

        probes = {rank: actor.__ray_ready__.remote() for rank, actor in enumerate(self._actors)}
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout_s)
        dead = {}
        for rank, probe in probes.items():
            if probe in ready:
                try:
                    ray.get(probe)
                except RayActorError as err:
                    dead[rank] = death_line(str(err))
        return dead

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank at once (collectives need all of them) and wait for all answers. A batch is
        serialised once, into Ray's object store, and every rank reads that one copy: passed inline it would be
        serialised once per rank, world-size copies of every batch through the driver."""
        import ray

        shared = [ray.put(arg) if isinstance(arg, TrainBatch) else arg for arg in args]
        return ray.get([getattr(a, method).remote(*shared) for a in self._actors])

    def compute_logprobs(self, batch: TrainBatch) -> Any:
        """Logprob of tokens[:, t+1] at position t with the current weights: FloatTensor [B, T], last column 0."""
        return self._all("compute_logprobs", batch)[0]

    def compute_values(self, batch: TrainBatch) -> Any:
        """The critic's values of the batch's tokens, FloatTensor [B, T] (loss.advantage_estimator gae only)."""
        return self._all("compute_values", batch)[0]

    def compute_old_logprobs(self, batch: TrainBatch) -> Any:
        """The old logprobs `train_step` would train `batch` against (trainer.old_logprobs: recomputed with the
        current weights, or each token's at its own version from the snapshots): FloatTensor [B, T]."""
        return self._all("compute_old_logprobs", batch)[0]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One PPO update on `batch`; returns rank 0's metrics (`train/*`, `old_logprobs/*`, `weights/version`)."""
        metrics = self._all("train_step", batch)[0]
        self.version = int(metrics["weights/version"])
        return metrics

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its part of a checkpoint into `directory` (glue.trainer.worker.save_checkpoint)."""
        self._all("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> int:
        """Every rank loads its part of the checkpoint in `directory`; the trainer is then at its version."""
        self.version = self._all("load_checkpoint", directory)[0]
        return self.version

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(HF name, dtype name, shape) of every weight the weight bridge sends, in bucket order."""
        import ray

        return ray.get(self._actors[0].hf_weight_specs.remote())

    def weight_channel_address(self, rank: int = 0) -> tuple[str, int]:
        """A source rank's node address and a port free there: where its weight group is hosted (across nodes the
        driver knows neither)."""
        import ray

        return tuple(ray.get(self._actors[rank].rendezvous_address.remote()))

    def weight_source_plan(self) -> list[tuple[int, list[str]]]:
        """The parallel weight sources of this layout: (source rank, the HF names it sends) each, one per pipeline
        stage and expert-parallel group (glue.trainer.weight_stream.WeightStream.source_plan)."""
        parts = self._all("weight_source_plan")[0]
        self._members.update({part.rank: part.members for part in parts})
        return [(part.rank, list(part.names)) for part in parts]

    def open_weight_channel(self, name: str, spec: dict[str, Any]) -> None:
        """Every rank learns the channel's buckets; the channel's source rank (`spec["source"]`, default 0) opens it
        (broadcast: blocks until every engine joined)."""
        self._all("open_weight_channel", name, spec)
        if "source" in spec:
            self._channel_members[name] = (spec["source"], self._members[spec["source"]])

    def stage_weights(self, with_tensor_checksums: bool = False) -> None:
        """Start a sync of the current weights. Nothing is gathered here: each bucket is, when it is sent, and its
        per-tensor checksums (verify: full) come back with it (`tensor_sums`)."""
        self._all("stage_weights", with_tensor_checksums)

    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]:
        """The ranks producing bucket `index` (those holding its shards, and the channel's source) gather it; the
        source sends it and answers with its checksum (and handle or path). A parallel source's channel calls only
        its own members, so the sources' buckets travel side by side."""
        import ray

        if channel not in self._channel_members:
            answers = self._all("send_weight_bucket", channel, index)
            served = {rank: answer["handles"] for rank, answer in enumerate(answers) if "handles" in answer}
            return {**answers[0], "handles_by_rank": served} if served else answers[0]  # ipc: entries of each GPU
        source, members = self._channel_members[channel]
        answers = ray.get([self._actors[r].send_weight_bucket.remote(channel, index) for r in members])
        return answers[members.index(source)]

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        """Delta sync: the ranks producing bucket `index` gather it and its source chooses whether it goes whole or
        as a delta, answering with the request fields the engines need; `send_weight_bucket` then sends it."""
        import ray

        if channel not in self._channel_members:
            return self._all("prepare_weight_bucket", channel, index, delta)[0]
        source, members = self._channel_members[channel]
        answers = ray.get([self._actors[r].prepare_weight_bucket.remote(channel, index, delta) for r in members])
        return answers[members.index(source)]

    def close_weight_channel(self, name: str) -> None:
        self._all("close_weight_channel", name)
        self._channel_members.pop(name, None)

    def full_hf_state(self) -> dict[str, Any]:
        """Every weight as a full HF-named CPU tensor (for checks and checkpoints)."""
        return self._all("full_hf_state")[0]

    def offload(self) -> int:
        """Colocated placement: every rank moves its weights and optimizer state to host memory before rollout;
        returns the bytes the ranks' training state still holds (0)."""
        return sum(self._all("offload"))

    def onload(self) -> int:
        """Colocated placement: every rank takes its weights and optimizer state back before training."""
        return sum(self._all("onload"))

    def shutdown(self) -> None:
        """Leave the process groups and kill the actors (idempotent)."""
        import ray

        actors, self._actors = self._actors, []
        if not actors:
            return
        ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors), timeout=30)
        for actor in actors:
            ray.kill(actor)


def death_line(error: str) -> str:
    """Ray's word on a dead actor in one line: why it is dead and its pid (`The actor is dead because its worker
    process has died. Worker exit type: ... (pid 3263)`), without Ray's list of common causes; its first line when
    the text has another shape."""
    lines = [line.strip() for line in error.strip().splitlines()] or ["the actor is gone"]
    reason = next((line for line in lines if line.startswith("The actor is dead because")), lines[0])
    pid = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("pid:")), None)
    return reason.split(" Some common causes")[0] + (f" (pid {pid})" if pid else "")
