"""The weight bridge's source on the trainer, bucket by bucket: a bucket's HF tensors are gathered from the ranks that
hold their shards just before it is packed (each shard sent to rank 0 of the owning TP or expert-TP group and copied
into the HF tensors as it arrives, then a point-to-point send to the source rank from other pipeline stages and
expert-parallel ranks) and dropped once it is sent. No rank holds more than its own shard plus about a bucket, and
nothing of the model is copied to host memory.
With parallel sources (`weight_sources`) each pipeline stage and expert group sends its own tensors from its own rank;
the launcher's plan calls the same functions on the layout it computes, so `--dry-run` lists the groups the bridge
builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from glue.trainer.model import model_tensors
from glue.trainer.parallel import hf_weight_specs
from weight_sync.convert import (from_te_names, local_name, num_experts, rule_to_hf, rules, shard_into_hf,
                                 shard_rank)
from weight_sync.families.table import REPLICATED
from weight_sync.sender import BucketSender

SOURCE_RANK = 0  # the trainer rank that sends every bucket with one source (pp, tp, dp, ep all 0)


@dataclass(frozen=True)
class SourcePart:
    """One parallel source: the rank that sends `names` (HF names, in bucket order) and every rank that takes part in
    producing them (the owning TP / expert-TP groups, and the source)."""

    rank: int
    members: tuple[int, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Coords:
    """A trainer rank's place, as megatron's parallel state reports it."""

    pp: int
    tp: int
    dp: int
    ep: int
    etp: int
    edp: int


@dataclass(frozen=True)
class Producer:
    """Where one converter rule's tensor lives: its pipeline stage and, for a routed expert, its EP rank; the
    owning group's leader (TP or expert-TP rank 0 of the first data-parallel replica) assembles it."""

    stage: int
    ep_rank: int | None
    leader: int  # global rank


StageLayout = Callable[[int, int], Any]  # (stage, ep_rank) -> the converter's ParallelLayout of a rank there


def find_producer(rule: Any, coords: list[Coords], stage_layout: StageLayout, n_experts: int) -> Producer:
    """Where `rule`'s tensor lives: the first stage whose layout (`stage_layout(stage, ep_rank)`, over the layout's
    pp_size stages) holds it and, for a routed expert, the EP rank holding that expert; its leader is TP rank 0 of the
    first data-parallel replica there (expert-TP rank 0 of the first expert-data-parallel replica for an expert)."""
    first = stage_layout(0, 0)
    stages = range(first.pp_size)
    if rule.expert is None:
        stage = next(s for s in stages if local_name(rule, stage_layout(s, 0), n_experts))
        return Producer(stage=stage, ep_rank=None, leader=_rank_where(coords, pp=stage, tp=0, dp=0))
    ep_rank = rule.expert // (n_experts // first.ep_size)
    stage = next(s for s in stages if local_name(rule, stage_layout(s, ep_rank), n_experts))
    return Producer(stage=stage, ep_rank=ep_rank, leader=_rank_where(coords, pp=stage, ep=ep_rank, etp=0, edp=0))


def _rank_where(coords: list[Coords], **where: int) -> int:
    matches = [r for r, c in enumerate(coords) if all(getattr(c, k) == v for k, v in where.items())]
    assert matches, f"no trainer rank at {where}"
    return matches[0]


def holds(producer: Producer, me: Coords) -> bool:
    """Is the rank at `me` in the group that assembles the producer's tensor (the first replica's TP or expert-TP
    group of its stage)?"""
    if me.pp != producer.stage:
        return False
    if producer.ep_rank is None:
        return me.dp == 0
    return me.ep == producer.ep_rank and me.edp == 0


def group_sources(hf_names: list[str], rules_of: dict[str, tuple[int, ...]], producers: list[Producer],
                  coords: list[Coords]) -> list[SourcePart]:
    """The parallel sources: each rule is sent by its producer's leader (one per pipeline stage, and one per stage
    and expert-parallel rank for routed experts), leaders whose producing ranks overlap merged into one source (the
    lowest leader, the others' tensors sent to it point to point), so no rank takes part in two sources' collectives
    at once. Sources in order of their rank; names in `hf_names` order. `rules_of`: HF name -> indices of its rules
    in `producers` (several for a tensor of every expert, gpt-oss's: its producers' leaders send to one source)."""
    members: dict[int, set[int]] = {}
    for producer in producers:
        holders = {r for r, c in enumerate(coords) if holds(producer, c)}
        members.setdefault(producer.leader, {producer.leader}).update(holders)
    for indices in rules_of.values():  # one HF tensor, several producers: they meet in one source
        leaders = {producers[i].leader for i in indices}
        for leader in leaders:
            members[leader].update(leaders)
    merged: list[tuple[set[int], set[int]]] = []  # (leaders, members)
    for leader, ranks in sorted(members.items()):
        joined = [m for m in merged if m[1] & ranks]
        merged = [m for m in merged if not m[1] & ranks]
        merged.append(({leader, *(l for m in joined for l in m[0])}, ranks.union(*(m[1] for m in joined))))
    source_of = {leader: min(leaders) for leaders, _ in merged for leader in leaders}
    parts = []
    for leaders, ranks in sorted(merged, key=lambda m: min(m[0])):
        rank = min(leaders)
        names = tuple(n for n in hf_names if source_of[producers[rules_of[n][0]].leader] == rank)
        parts.append(SourcePart(rank=rank, members=tuple(sorted(ranks)), names=names))
    return parts


def weight_sources(hf_config: Any, coords: list[Coords], stage_layout: StageLayout) -> list[SourcePart]:
    """The parallel sources of the model `hf_config` describes, trained at `coords` (every rank's, by global rank)
    with stages and expert groups as `stage_layout` places them; names in the order the bridge sends them (the
    converter's rule order). What `WeightStream.source_plan` answers on a running trainer, from the layout alone."""
    table, n_experts = rules(hf_config), num_experts(hf_config)
    producers = [find_producer(rule, coords, stage_layout, n_experts) for rule in table]
    return group_sources(list(dict.fromkeys(name for rule in table for name in rule.hf)), rules_by_name(table),
                         producers, coords)


def rules_by_name(table: list[Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> the indices of the rules that make it (one, or one per expert of a tensor of every expert)."""
    out: dict[str, tuple[int, ...]] = {}
    for i, rule in enumerate(table):
        for name in rule.hf:
            out[name] = (*out.get(name, ()), i)
    return out


class WeightStream:
    """Per-bucket HF tensors of a megatron-core model on the source rank. Every trainer rank calls `bucket(names)`
    with the same names in the same (bucket) order; `reset()` starts a new sync."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, place: Any):
        from megatron.core import parallel_state as ps

        self.model, self.hf_config, self.place = model, hf_config, place
        # by the converter's (local) names, whichever layer spec built the model; the Parameter objects stay
        # (offload swaps only their .data)
        self.params = from_te_names(model_tensors(model))
        self.rank = torch.distributed.get_rank()
        self.n_experts = num_experts(hf_config)
        mine = Coords(pp=place.pp_rank, tp=place.tp_rank, dp=place.dp_rank, ep=place.ep_rank, etp=place.etp_rank,
                      edp=ps.get_expert_data_parallel_rank())
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        self.coords: list[Coords] = everyone
        self.me = mine
        self.rules = rules(hf_config)
        self.rules_of = rules_by_name(self.rules)
        stage_layout = lambda stage, ep_rank: place.layout(tp_rank=0, member=(ep_rank, 0), stage=stage)  # noqa: E731
        self.producers = [find_producer(rule, self.coords, stage_layout, self.n_experts) for rule in self.rules]
        self.groups = {"dense": ps.get_tensor_model_parallel_group(), "expert": ps.get_expert_tensor_parallel_group()}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._made: set[int] = set()  # rules produced in this sync (their HF names may span two buckets)
        self._ready: dict[str, torch.Tensor] = {}  # source rank: produced HF tensors not yet in a bucket

    def source_plan(self, hf_names: list[str]) -> list[SourcePart]:
        """The parallel sources of this layout (`group_sources`); names in `hf_names` order."""
        return group_sources(hf_names, self.rules_of, self.producers, self.coords)

    def reset(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """A new sync: nothing produced yet. `specs`: (HF name, dtype, shape) of every tensor, for the source's
        receive buffers."""
        self.specs = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}
        self._made.clear()
        self._ready.clear()

    def bucket(self, names: list[str], source: int = SOURCE_RANK) -> dict[str, torch.Tensor]:
        """Collective over the ranks that produce `names` (every rank may call it; the others return at once): the
        HF tensors `names` on the `source` rank, {} on the others. Only the ranks that hold a shard of a tensor, and
        the source, take part in producing it."""
        sends: list[tuple[Any, torch.Tensor]] = []
        for index in dict.fromkeys(i for name in names for i in self.rules_of[name]):
            if index in self._made:
                continue
            self._made.add(index)
            self._keep(self.rules[index], self._produce(index, sends, source))
        for request, _ in sends:  # the tensors stay referenced until their sends complete
            request.wait()
        return {name: self._ready.pop(name) for name in names} if self.rank == source else {}

    def _keep(self, rule: Any, tensors: dict[str, torch.Tensor]) -> None:
        """File a rule's produced HF tensors until their bucket is sent; an expert's slice goes into its place in
        the HF tensor of every expert."""
        if not rule.is_expert_slice:
            self._ready.update(tensors)
            return
        for name, piece in tensors.items():
            dtype, shape = self.specs[name]
            whole = self._ready.setdefault(name, torch.empty(shape, dtype=dtype, device=piece.device))
            whole[rule.expert].copy_(piece)

    # ---- one rule
    def _produce(self, index: int, sends: list, source: int) -> dict[str, torch.Tensor]:
        rule, producer = self.rules[index], self.producers[index]
        if holds(producer, self.me):
            layout = self.place.layout()
            shard = self.params[local_name(rule, layout, self.n_experts)].data
            rank, size = shard_rank(rule, layout)
            if size > 1 and rule.kind != REPLICATED:
                assert not rule.is_expert_slice, "experts of a fused HF tensor are built at expert TP 1 (gpt-oss)"
                tensors = self._gather_shards(index, shard.contiguous(), rank, size, sends)
            else:  # views of the parameter (q/k/v split apart are copies: no view has their shape)
                tensors = rule_to_hf(rule, [shard], self.hf_config, copy=False) if rank == 0 else {}
            if rank != 0:
                return {}
            if self.rank == source:
                return tensors
            for name in rule.hf:
                tensor = tensors[name].contiguous()
                sends.append((torch.distributed.isend(tensor, dst=source), tensor))
            return {}
        if self.rank != source:
            return {}
        received = {}
        for name in rule.hf:
            dtype, shape = self.specs[name]
            shape = shape[1:] if rule.is_expert_slice else shape  # one expert's slice
            received[name] = torch.empty(shape, dtype=dtype, device=self._device())
            torch.distributed.recv(received[name], src=producer.leader)
        return received

    def _gather_shards(self, index: int, shard: torch.Tensor, rank: int, size: int, sends: list
                       ) -> dict[str, torch.Tensor]:
        """Rule `index`'s HF tensors on rank 0 of its TP (or expert-TP) group, {} on the other members, which send
        it their shard (kept in `sends` until received). Rank 0 allocates the HF tensors and copies each shard into
        its place as it arrives, through one shard-sized buffer: the tensor plus one shard, not every shard, their
        concatenation and the split copies at once (nor gloo's all-gather's own flat copy)."""
        rule = self.rules[index]
        group = self.groups["dense" if rule.expert is None else "expert"]
        if rank != 0:
            sends.append((torch.distributed.isend(shard, dst=torch.distributed.get_global_rank(group, 0),
                                                  group=group), shard))
            return {}
        tensors = {name: torch.empty(self.specs[name][1], dtype=self.specs[name][0], device=shard.device)
                   for name in rule.hf}
        hf = list(tensors.values())
        shard_into_hf(rule, shard, 0, size, hf, self.hf_config)
        arriving = torch.empty_like(shard)
        for other in range(1, size):
            torch.distributed.recv(arriving, src=torch.distributed.get_global_rank(group, other), group=group)
            shard_into_hf(rule, arriving, other, size, hf, self.hf_config)
        return tensors

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


class TrainerWeightSender:
    """One trainer rank's side of the bridge's calls to its `WeightSource` (weight_sync.transports; the driver's
    `TrainerGroup` fans them out to every rank). A channel has one sending rank (its spec's `source`, default rank 0:
    one source for the whole model), which holds the channel (weight_sync.sender.BucketSender) and sends; the ranks
    that produce its tensors take part in each send."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, place: Any):
        self.model, self.hf_config, self.place = model, hf_config, place
        self.rank = torch.distributed.get_rank()
        self.bucket_names: dict[str, list[list[str]]] = {}  # channel -> the HF names of each of its buckets
        self.channel_source: dict[str, int] = {}  # channel -> the rank that sends it
        self.copy_groups: dict[str, tuple[list[int], Any]] = {}  # ipc channel -> ranks holding a copy, their group
        self._groups: dict[tuple[int, ...], Any] = {}  # those groups by ranks, kept for the trainer's life
        self.staged_version: int | None = None  # the version stage() was called at, for send()'s guard
        self.tensor_sums = False  # verify: full: every bucket's send reports its per-tensor checksums
        self._stream: WeightStream | None = None
        self._sender: Any = None  # weight_sync.sender.BucketSender, on sending ranks only
        self._prepared: set[tuple[str, int]] = set()  # delta sync: buckets gathered and chosen, not yet sent

    def _ensure_stream(self) -> WeightStream:
        """The stream (collective the first time: it learns every rank's coordinates)."""
        if self._stream is None:
            self._stream = WeightStream(self.model, self.hf_config, self.place)
        return self._stream

    def source_plan(self) -> list[SourcePart]:
        """Collective: the parallel sources of this model's layout (`WeightStream.source_plan`)."""
        return self._ensure_stream().source_plan([n for n, _, _ in hf_weight_specs(self.model, self.hf_config,
                                                                                   self.place)])

    def open(self, name: str, spec: dict[str, Any]) -> None:
        """Every rank learns the channel's buckets; its sending rank opens it (broadcast: blocks until every engine
        joined)."""
        self.bucket_names[name] = [list(layout["names"]) for layout in spec["layouts"]]
        source = self.channel_source[name] = int(spec.get("source", SOURCE_RANK))
        serve = {int(rank): tp_ranks for rank, tp_ranks in spec.get("serve", {}).items()}  # ipc: one source per GPU
        copies = sorted({source, *serve})
        if len(copies) > 1:  # collective: every rank creates every group, once per set of ranks (reopens reuse it)
            if tuple(copies) not in self._groups:
                self._groups[tuple(copies)] = torch.distributed.new_group(copies)
            self.copy_groups[name] = (copies, self._groups[tuple(copies)])
        if self.rank in copies:
            if self._sender is None:
                self._sender = BucketSender()
            mine = {**spec, "tp_ranks": serve.get(self.rank, [])} if serve else spec
            self._sender.open_channel(name, mine, streamed=True)

    def stage(self, version: int, with_tensor_checksums: bool) -> None:
        """Start a sync of the weights at `version`: nothing is gathered yet (each bucket is, when it is sent).
        Collective the first time (the stream learns every rank's coordinates)."""
        stream = self._ensure_stream()
        stream.reset(hf_weight_specs(self.model, self.hf_config, self.place))
        self.staged_version = version
        self.tensor_sums = with_tensor_checksums
        self._prepared.clear()

    def send(self, channel: str, index: int, version: int) -> dict[str, Any]:
        """Collective over the ranks producing the channel's tensors: gather bucket `index` of `channel`
        (weight_stream.WeightStream) and, on the channel's sending rank, send it in one call to the sender, which
        answers with what the channel reports (checksum, handle or path, timings) plus, when staged with tensor
        checksums, `tensor_sums` of the bucket's tensors. Refuses once a train step ran since `stage`: the bucket
        would carry that step's weights under the staged version's tag."""
        self._check_staged(channel, version)
        assert self._stream is not None, "stage() makes the stream"
        source = self.channel_source[channel]
        if (channel, index) in self._prepared:  # gathered and chosen by prepare()
            self._prepared.discard((channel, index))
            return self._sender.send_bucket(channel, index) if self.rank == source else {}
        tensors = self._stream.bucket(self.bucket_names[channel][index], source)
        out = self._sender.send_bucket(channel, index, tensors, tensor_sums=self.tensor_sums) \
            if self.rank == source else {}
        if channel in self.copy_groups and self.rank in self.copy_groups[channel][0]:
            out = self._copy_bucket(channel, index, source, out)
        return out

    def _copy_bucket(self, channel: str, index: int, source: int, out: dict[str, Any]) -> dict[str, Any]:
        """ipc, one source per GPU: the channel's source broadcasts the bucket it packed to every rank that serves
        engine ranks on its own GPU, straight into that rank's shared buffer, which then answers its own entries."""
        ranks, group = self.copy_groups[channel]
        buffer = self._sender.bucket_buffer(channel, index, next(self.model.parameters()).device)
        torch.distributed.broadcast(buffer, src=source, group=group)
        return out if self.rank == source else self._sender.share_bucket(channel, index)

    def prepare(self, channel: str, index: int, version: int, delta: bool) -> dict[str, Any]:
        """Delta sync: like `send` up to the wire: gather bucket `index` and, on the sending rank, choose whether it
        goes whole or as a delta (weight_sync.sender.BucketSender.prepare_bucket, which keeps the bucket's tensor
        checksums for its send); the next `send` of it sends that. The sender answers with the request fields the
        engines need."""
        self._check_staged(channel, version)
        assert self._stream is not None, "stage() makes the stream"
        source = self.channel_source[channel]
        tensors = self._stream.bucket(self.bucket_names[channel][index], source)
        if self.rank != source:
            self._prepared.add((channel, index))
            return {}
        answer = self._sender.prepare_bucket(channel, index, delta, tensors, tensor_sums=self.tensor_sums)
        self._prepared.add((channel, index))
        return answer

    def _check_staged(self, channel: str, version: int) -> None:
        if self.staged_version != version:
            staged = "nothing is staged" if self.staged_version is None else f"version {self.staged_version} was staged"
            raise RuntimeError(f"send_weight_bucket: {staged} but the trainer is at version {version}; call "
                               "stage_weights again and send every bucket before the next train_step")
        if channel not in self.bucket_names:
            raise RuntimeError(f"weight channel {channel!r} is not open (open: {sorted(self.bucket_names)})")

    def drop_staged(self) -> None:
        """Forget the staged sync (offload: the next sync stages again)."""
        self.staged_version = None

    def close(self, name: str | None = None) -> None:
        """Close one channel, or every channel."""
        for channel in [name] if name is not None else list(self.bucket_names):
            self.bucket_names.pop(channel, None)
            self.channel_source.pop(channel, None)
            self.copy_groups.pop(channel, None)
            if self._sender is not None:
                self._sender.close_channel(channel)
