"""Driver side of the trainer: one `TrainerWorker` Ray actor per rank (TP x PP x CP x DP), wired to one
torch.distributed group, behind blocking methods the controller and the weight bridge call. Assumes `ray.init` was
done."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from glue.fleet.fleet import ProcessDied
from glue.fleet.placing import ray_death_reason
from glue.trainer.config import TrainerConfig
from glue.trainer.worker import TrainerWorker
from glue.types import TrainBatch

RAY_WORKER_LOGS = "/tmp/ray/session_latest/logs/worker-*"  # where Ray puts an actor's output on its node

if TYPE_CHECKING:  # the driver side stays free of the loss package's torch math
    from loss import LossConfig, SftLossConfig


class TrainerGroup:
    """The trainer as the loop sees it: `train_step`, `compute_logprobs`, `version` (+1 per train_step), and the
    weight-source calls."""

    def __init__(self, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig | SftLossConfig,
                 actor_options: Sequence[dict[str, Any]] | None = None, keep_versions: int = 1,
                 placement_timeout_s: float | None = 300.0, log_dir: Path | None = None):
        """`actor_options[rank]`: Ray options placing that rank (placement-group bundle, GPUs; see
        launch.run.cluster); by default each rank just reserves `cfg.num_cpus_per_worker` CPUs. `keep_versions`: policy
        versions each rank keeps on the host for `trainer.old_logprobs: snapshot` (sync.max_staleness + 1).
        `placement_timeout_s`: how long the ranks' processes may take to start on their bundles (a bundle whose node
        is gone may never come back) before the start fails, naming the ranks that have none. `log_dir`: an existing
        folder where rank r writes its output, `trainer_<r>.log`, if its node sees the folder (a shared file system);
        a rank that cannot stays in its node's Ray logs, and `output_line` says so."""
        if actor_options is not None and len(actor_options) != cfg.world_size:
            raise ValueError(f"TrainerGroup: {len(actor_options)} actor_options for {cfg.world_size} ranks")
        self.cfg = cfg
        self._start = dict(model_path=model_path, loss_cfg=loss_cfg, actor_options=actor_options,
                           keep_versions=keep_versions, log_dir=log_dir)  # what `restart` starts the ranks with again
        self.placement_timeout_s = placement_timeout_s
        self._start_ranks(**self._start)

    def _start_ranks(self, model_path: str, loss_cfg: LossConfig | SftLossConfig,
                     actor_options: Sequence[dict[str, Any]] | None, keep_versions: int, log_dir: Path | None) -> None:
        import ray

        cfg = self.cfg
        self.version = 0
        self._members: dict[int, tuple[int, ...]] = {}  # parallel source rank -> the ranks producing its tensors
        self._channel_members: dict[str, tuple[int, tuple[int, ...]]] = {}  # a parallel channel -> (source, members)
        self.nodes: list[str] = []  # each rank's node once it started, for the line that says one died
        self.logs = [None if log_dir is None else log_dir / f"trainer_{rank}.log" for rank in range(cfg.world_size)]
        actor_cls = ray.remote(TrainerWorker)
        self._actors = [
            actor_cls.options(**(actor_options[rank] if actor_options else {"num_cpus": cfg.num_cpus_per_worker}))
            .remote(model_path=model_path, cfg=cfg, loss_cfg=loss_cfg, rank=rank, world_size=cfg.world_size,
                    keep_versions=keep_versions, log_path=None if log is None else str(log))
            for rank, log in enumerate(self.logs)
        ]
        self._wait_for_placement()
        try:
            places = self._get([a.rendezvous_address.remote() for a in self._actors])
            self.nodes = [host for host, _ in places]
            address, port = places[0]
            lines = self._get([a.initialize.remote(address, cfg.master_port or port) for a in self._actors])
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
        """The ranks whose actor is gone, each with Ray's reason in one line (`ray_death_reason`). A rank busy in a call
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
                    dead[rank] = ray_death_reason(str(err))
        return dead

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank at once (collectives need all of them) and wait for all answers. A batch is
        serialised once, into Ray's object store, and every rank reads that one copy: passed inline it would be
        serialised once per rank, world-size copies of every batch through the driver."""
        import ray

        shared = [ray.put(arg) if isinstance(arg, TrainBatch) else arg for arg in args]
        return self._get([getattr(a, method).remote(*shared) for a in self._actors])

    def _get(self, refs: list[Any]) -> list[Any]:
        """ray.get, but a dead rank raises ProcessDied naming the rank, its node and its log."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(refs)
        except RayActorError as err:
            raise ProcessDied(self.death_line(err)) from err

    def death_line(self, err: Any) -> str:
        """E.g. `trainer rank 1 on node 10.0.0.2 died (The actor died unexpectedly ...); its log: runs/x/logs/
        trainer_1.log`, from Ray's RayActorError `err` (`stopped answering` when Ray cannot reach it: its node may be
        gone)."""
        from ray.exceptions import ActorUnavailableError

        dead = err.actor_id.hex() if isinstance(err.actor_id, bytes) else err.actor_id
        ranks = [rank for rank, actor in enumerate(self._actors) if actor._actor_id.hex() == dead]
        why = ray_death_reason(str(err))
        what = "stopped answering" if isinstance(err, ActorUnavailableError) else "died"
        if not ranks:
            return f"a trainer rank {what} ({why})"
        rank = ranks[0]
        node = self.nodes[rank] if self.nodes else None
        log = self.logs[rank]
        if log is None or not log.exists():
            log = f"the Ray worker logs of {node or 'its node'} ({RAY_WORKER_LOGS})"
        node = f" on node {node}" if node else ""
        return f"trainer rank {rank}{node} {what} ({why}); its log: {log}"

    def output_line(self) -> str:
        """Where the ranks' output is, e.g. `output in runs/x/logs/trainer_<rank>.log`, naming the ranks whose node
        cannot see that folder (their output stays in that node's Ray worker logs)."""
        if self.logs[0] is None:
            return f"output in the Ray worker logs of each rank's node ({RAY_WORKER_LOGS})"
        elsewhere = [f"rank {rank} on {self.nodes[rank]}" for rank, log in enumerate(self.logs) if not log.exists()]
        return f"output in {self.logs[0].parent}/trainer_<rank>.log" + (
            f" (not {', '.join(elsewhere)}: that node cannot see the folder, so it is in the node's Ray worker "
            f"logs, {RAY_WORKER_LOGS})" if elsewhere else "")

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
        return self._get([self._actors[0].hf_weight_specs.remote()])[0]

    def weight_channel_address(self, rank: int = 0) -> tuple[str, int]:
        """A source rank's node address and a port free there: where its weight group is hosted (across nodes the
        driver knows neither)."""
        return tuple(self._get([self._actors[rank].rendezvous_address.remote()])[0])

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
        if channel not in self._channel_members:
            answers = self._all("send_weight_bucket", channel, index)
            served = {rank: answer["handles"] for rank, answer in enumerate(answers) if "handles" in answer}
            return {**answers[0], "handles_by_rank": served} if served else answers[0]  # ipc: entries of each GPU
        source, members = self._channel_members[channel]
        answers = self._get([self._actors[r].send_weight_bucket.remote(channel, index) for r in members])
        return answers[members.index(source)]

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        """Delta sync: the ranks producing bucket `index` gather it and its source chooses whether it goes whole or
        as a delta, answering with the request fields the engines need; `send_weight_bucket` then sends it."""
        if channel not in self._channel_members:
            return self._all("prepare_weight_bucket", channel, index, delta)[0]
        source, members = self._channel_members[channel]
        answers = self._get([self._actors[r].prepare_weight_bucket.remote(channel, index, delta) for r in members])
        return answers[members.index(source)]

    def close_weight_channel(self, name: str) -> None:
        """Every rank closes its side of the channel. A dead rank's side went with it: the run is already ending
        with the line naming it (ProcessDied), which an error from this shutdown call must not replace."""
        self._channel_members.pop(name, None)
        try:
            self._all("close_weight_channel", name)
        except ProcessDied:
            pass

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
