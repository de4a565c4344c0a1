"""ParallelConfig: how a model is cut across devices.

One object holds the data, operator-level model and pipeline sizes; every sharded layer
derives its operator strategies from it, and the parallel context derives the launch setup
and which data each rank reads.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from model_zoo.errors import ConfigError

RECOMPUTE_CHOICES = (False, True, "selective")
PIPELINE_SCHEDULERS = ("1f1b", "seqpipe")   # MindSpore's, as `AutoParallel.pipeline` names them


@dataclass
class ParallelConfig:
    """Sizes of each kind of parallelism.

    Args:
        data_parallel: number of replicas that each take a slice of the batch (dp).
        model_parallel: number of devices an operator's weights are split over (mp).
        pipeline_stage: number of pipeline stages the layers are spread over (pp).
        micro_batch_num: micro batches per step flowing through the pipeline.
        optimizer_shard: shard optimizer state (and weights) over the data-parallel group.
        recompute: false; true: recompute each block's activations in the backward pass
            (only its input is kept); selective: recompute only the attention core of each
            block (scores, softmax, dropout, context: the (seq x seq) tensors), keeping the
            projections' activations (Korthikanti et al. 2022, MindFormers'
            select_recompute); with flash attention selective keeps nothing more, since the
            fused kernel already recomputes its scores.
        recompute_blocks: per pipeline stage, how many of the stage's blocks (its first)
            are recomputed as `recompute` says; the others keep their activations. Default:
            all of them. Earlier stages hold more micro batches in flight on a 1F1B
            pipeline, so they are the ones that need it.
        stage_blocks: per pipeline stage, how many blocks it holds (in order). Default:
            num_layers / pipeline_stage each. A last stage that also holds the vocabulary
            projection runs faster with a block fewer (MindFormers' pipeline offset).
        vocab_emb_dp: keep the vocabulary embedding whole on each device (split its lookup
            by batch); when False the table is split by vocabulary over model_parallel.
        full_batch: every rank reads the whole global batch (MindSpore's "full_batch"
            dataset strategy) instead of its own slice ("data_parallel", the default).
        sequence_parallel: split the tokens of the residual stream (layer norms, hidden
            dropouts, residual adds) over dp x mp instead of dp, and reduce-scatter the
            row-split projections' outputs instead of all-reducing them (MindFormers'
            use_seq_parallel); needs model_parallel > 1.
        pipeline_interleave: virtual stages per device: the blocks are cut into
            pipeline_stage x pipeline_interleave equal chunks, chunk c on stage c mod
            pipeline_stage, so a micro batch passes every device that many times and the
            pipeline fills and drains in chunk-sized steps (MindSpore's
            `pipeline(interleave=True)`, MindFormers' pp_interleave_num; Megatron's virtual
            pipeline). 1: one chunk a stage.
        expert_parallel: devices a mixture-of-experts layer's experts are split over (ep):
            each holds num_experts / ep of them, and every expert is replicated over
            data_parallel / ep devices; tokens reach their experts' devices by AllToAll
            (`nn.moe`). It divides data_parallel, as in MindFormers' MoE (the experts take
            the data-parallel devices, the expert width is still split over model_parallel).
        pipeline_scheduler: MindSpore's pipeline schedule: "1f1b" (the default) or, with
            interleave, "seqpipe". MindSpore's "zero_bubble_v" is not offered: its V puts the
            last chunk, and so the loss, on the first stage.
    """

    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    optimizer_shard: bool = False
    recompute: Union[bool, str] = False
    recompute_blocks: Optional[List[int]] = None
    stage_blocks: Optional[List[int]] = None
    vocab_emb_dp: bool = True
    full_batch: bool = False
    sequence_parallel: bool = False
    pipeline_interleave: int = 1
    pipeline_scheduler: str = "1f1b"
    expert_parallel: int = 1

    @property
    def dp(self) -> int:
        return self.data_parallel

    @property
    def mp(self) -> int:
        return self.model_parallel

    @property
    def device_num(self) -> int:
        """Devices the layout needs: dp x mp x pp."""
        return self.data_parallel * self.model_parallel * self.pipeline_stage

    @property
    def devices_per_stage(self) -> int:
        """Devices of one pipeline stage (MindSpore's S): dp x mp."""
        return self.data_parallel * self.model_parallel

    def data_parallel_for(self, device_num: int) -> int:
        """The data_parallel that lays this layout out over a job of `device_num` devices,
        as the launch scripts do: its own when dp x mp x pp already uses them all; for a
        layout made for fewer devices (a one-device config, or one server's layout on two),
        the data-parallel replicas that fill them, mp and pp kept. ConfigError when the
        layout needs more devices than that, or mp x pp does not divide them."""
        if self.device_num == device_num:
            return self.data_parallel
        per_replica = self.model_parallel * self.pipeline_stage
        layout = (f"data_parallel {self.data_parallel} x model_parallel {self.model_parallel} "
                  f"x pipeline_stage {self.pipeline_stage} = {self.device_num} devices")
        if self.device_num > device_num:
            raise ConfigError(f"the layout needs more devices than the job has ({layout}, "
                              f"DEVICE_NUM {device_num}): lower parallel.data_parallel or "
                              f"launch more devices")
        if device_num % per_replica:
            raise ConfigError(f"DEVICE_NUM {device_num} is not a multiple of model_parallel "
                              f"x pipeline_stage = {per_replica} ({layout}): no data_parallel "
                              f"fills the job")
        return device_num // per_replica

    def validate(self):
        """Check the sizes on their own; raises ConfigError naming the key."""
        for key in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                    "expert_parallel"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {value}")
        if self.data_parallel % self.expert_parallel:
            raise ConfigError(f"parallel.expert_parallel={self.expert_parallel} must divide "
                              f"parallel.data_parallel={self.data_parallel}: the experts are "
                              f"split over data-parallel devices")
        if self.pipeline_stage > 1 and self.micro_batch_num < self.pipeline_stage:
            raise ConfigError(
                f"parallel.micro_batch_num={self.micro_batch_num} must be at least "
                f"parallel.pipeline_stage={self.pipeline_stage}: each stage needs a micro batch "
                "in flight")
        self.check_sequence_parallel()
        self.check_recompute()
        self.check_pipeline_schedule()

    def check_pipeline_schedule(self):
        """Raise ConfigError naming the key for an interleave or scheduler that is not one
        or that the layout cannot take."""
        if self.pipeline_interleave < 1:
            raise ConfigError(f"parallel.pipeline_interleave must be >= 1, got "
                              f"{self.pipeline_interleave}")
        if self.pipeline_scheduler not in PIPELINE_SCHEDULERS:
            raise ConfigError(f"parallel.pipeline_scheduler must be one of "
                              f"{', '.join(PIPELINE_SCHEDULERS)}, got {self.pipeline_scheduler!r}")
        if self.pipeline_interleave > 1 and self.pipeline_stage == 1:
            raise ConfigError("parallel.pipeline_interleave > 1 needs parallel.pipeline_stage > 1")
        if self.pipeline_interleave > 1 and self.stage_blocks is not None:
            raise ConfigError("parallel.stage_blocks cannot be combined with "
                              "parallel.pipeline_interleave > 1: the chunks are equal")
        if self.pipeline_interleave > 1 and self.micro_batch_num % self.pipeline_stage:
            raise ConfigError(f"parallel.micro_batch_num={self.micro_batch_num} must be a "
                              f"multiple of parallel.pipeline_stage={self.pipeline_stage} with "
                              f"parallel.pipeline_interleave: the interleaved schedule runs the "
                              f"micro batches in rounds of one a stage (as Megatron's does)")
        if self.pipeline_scheduler != "1f1b" and self.pipeline_interleave == 1:
            raise ConfigError(f"parallel.pipeline_scheduler {self.pipeline_scheduler} "
                              f"schedules interleaved chunks: set parallel.pipeline_interleave "
                              f"> 1, or use 1f1b")

    def block_chunks(self, blocks: int) -> List[tuple]:
        """(stage, chunk) of each of the model's `blocks` in order. Without interleave
        chunk 0 and `blocks_per_stage`; with it the blocks cut into pipeline_stage x
        pipeline_interleave equal chunks, chunk c on stage c mod pipeline_stage (as
        MindFormers' LayerSetting lays them out). ConfigError when they do not divide."""
        if self.pipeline_interleave == 1:
            return [(stage, 0) for stage, count in enumerate(self.blocks_per_stage(blocks))
                    for _ in range(count)]
        self.blocks_per_stage(blocks)   # the other checks
        chunks = self.pipeline_stage * self.pipeline_interleave
        if blocks % chunks:
            raise ConfigError(
                f"model.num_layers: the model's {blocks} blocks do not divide into "
                f"parallel.pipeline_stage x parallel.pipeline_interleave = {chunks} equal "
                f"chunks")
        placed = []
        for index in range(blocks):
            chunk, stage = divmod(index // (blocks // chunks), self.pipeline_stage)
            placed.append((stage, chunk))
        return placed

    def check_recompute(self):
        """Raise ConfigError naming the key for a recompute mode or a per-stage list that
        is not one."""
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(f"parallel.recompute must be false, true or selective, got "
                              f"{self.recompute!r}")
        for key in ("recompute_blocks", "stage_blocks"):
            counts = getattr(self, key)
            least = 1 if key == "stage_blocks" else 0
            if counts is not None and (len(counts) != self.pipeline_stage
                                       or min(counts) < least):
                raise ConfigError(
                    f"parallel.{key} must list one count for each of the "
                    f"{self.pipeline_stage} pipeline stages ({least} or more each), got "
                    f"{counts}")

    def blocks_per_stage(self, blocks: int) -> List[int]:
        """How many of the model's `blocks` (`ModelConfig.pipeline_blocks`: its layers, the
        Transformer's encoder and decoder layers) each pipeline stage holds (`stage_blocks`,
        else even); raises ConfigError naming the key when they do not add up."""
        self.check_recompute()
        if self.stage_blocks is None:
            if blocks % self.pipeline_stage:
                raise ConfigError(
                    f"model.num_layers: the model's {blocks} blocks do not divide into "
                    f"parallel.pipeline_stage={self.pipeline_stage} equal stages; change "
                    f"either, or list each stage's blocks in parallel.stage_blocks")
            return [blocks // self.pipeline_stage] * self.pipeline_stage
        if sum(self.stage_blocks) != blocks:
            raise ConfigError(f"parallel.stage_blocks={self.stage_blocks} holds "
                              f"{sum(self.stage_blocks)} blocks but the model has {blocks} "
                              f"(model.num_layers)")
        return list(self.stage_blocks)

    def recomputed_blocks(self, blocks: int) -> List[int]:
        """How many blocks of each stage are recomputed (fully or selectively, as
        `recompute` says): `recompute_blocks` (no more than the stage holds), else all of
        them when recompute is on, none when off."""
        per_stage = self.blocks_per_stage(blocks)
        if not self.recompute and self.recompute_blocks is not None:
            raise ConfigError("parallel.recompute_blocks says how many blocks of each stage "
                              "to recompute: it needs parallel.recompute true or selective")
        if not self.recompute:
            return [0] * len(per_stage)
        if self.recompute_blocks is None:
            return per_stage
        for stage, (wanted, held) in enumerate(zip(self.recompute_blocks, per_stage)):
            if wanted > held:
                raise ConfigError(f"parallel.recompute_blocks[{stage}]={wanted} is more than "
                                  f"the {held} blocks stage {stage} holds")
        return list(self.recompute_blocks)

    def check_sequence_parallel(self):
        """Raise ConfigError if sequence parallel is asked for without model parallel."""
        if self.sequence_parallel and self.model_parallel == 1:
            raise ConfigError(
                "parallel.sequence_parallel=true needs parallel.model_parallel > 1: it splits "
                "the tokens of the layer norms, dropouts and residual adds over the "
                "model-parallel group")

    def batch_slices(self) -> int:
        """Number of equal pieces the global batch is cut into by the dataset and pipeline.

        With the default dataset strategy each of the devices_per_stage ranks reads its own
        slice and the pipeline cuts it into micro batches; with full_batch every rank reads
        the whole batch, which the pipeline cuts into micro batches and each operator then
        splits by data_parallel.
        """
        if self.full_batch:
            return self.micro_batch_num * self.data_parallel
        return self.micro_batch_num * self.devices_per_stage

    def micro_batch_size(self, global_batch_size: int, accumulation: int = 1) -> int:
        """Sequences in one micro batch of the whole stage: what every operator sees."""
        return max(1, global_batch_size // max(1, accumulation * self.micro_batch_num))

    def check_sequence_split(self, micro_batch: int, seq_length: int):
        """Raise ConfigError unless sequence parallel's dp x mp pieces of a micro batch's
        tokens are whole sequences or equal parts of one: only then does the (tokens, hidden)
        view the stream is split on read as (batch, seq, hidden) without moving data."""
        if not self.sequence_parallel:
            return
        pieces = self.dp * self.mp
        if micro_batch % pieces == 0 or (pieces % micro_batch == 0
                                         and seq_length % (pieces // micro_batch) == 0):
            return
        raise ConfigError(
            f"parallel.sequence_parallel: a micro batch of {micro_batch} sequences of "
            f"{seq_length} tokens does not cut into data_parallel x model_parallel = {pieces} "
            f"whole sequences or equal parts of one; make the micro batch (train."
            f"global_batch_size / (train.grad_accumulation x parallel.micro_batch_num)) a "
            f"multiple or a divisor of {pieces}")

    def check_batch(self, global_batch_size: int, accumulation: int = 1):
        """Raise ConfigError if the global batch cannot be cut evenly."""
        slices = self.batch_slices() * accumulation
        if global_batch_size % slices:
            how = ("micro_batch_num x data_parallel" if self.full_batch
                   else "micro_batch_num x data_parallel x model_parallel")
            if accumulation > 1:
                how += " x train.grad_accumulation"
            raise ConfigError(
                f"train.global_batch_size={global_batch_size} is not divisible by {slices} "
                f"({how}): each rank needs an equal whole slice")

    def check_divisible(self, name: str, value: int, by: str = "model_parallel"):
        """Raise ConfigError unless `value` (the config key `name`) divides by a parallel size."""
        size = getattr(self, by)
        if value % size:
            raise ConfigError(f"{name}={value} is not divisible by parallel.{by}={size}")
