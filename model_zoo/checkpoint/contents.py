"""What a training checkpoint holds: the train step's parameters by name, which of them a
checkpoint saves and which a resume needs back."""

STOP_FLAG = "stop_requested"  # the StopVote parameter; not saved in checkpoints
STEP_TALLY = "step_tally"     # the StepTally parameter; not saved in checkpoints
STEP_COUNTER = "train_step"   # the TrainStep's count of steps run
LOSS_AVERAGE = "loss_average"   # running average of the applied steps' losses (spikes)
GRADIENT_BUFFERS = "accu_grads"   # prefix of the micro batches' gradient sums: zeros
                                  # between steps, so not saved in checkpoints
# a mixture of experts' record of its last routing (`nn.moe`), for the run log: not saved
ROUTING_RECORD = ("expert_load", "expert_dropped")


def saved_in_checkpoints(name: str) -> bool:
    """Whether a train step's parameter `name` is saved in checkpoints: all but the stop
    vote, the tally the loop reads, the gradient buffers (zeros between steps) and the
    experts' routing records."""
    return (name not in (STOP_FLAG, STEP_TALLY) and not name.startswith(GRADIENT_BUFFERS + ".")
            and name.rsplit(".", 1)[-1] not in ROUTING_RECORD)


def needed_from_checkpoints(name: str) -> bool:
    """Whether a resume needs `name` from the checkpoint: what is saved, but the spike
    check's running average, which checkpoints of earlier versions lack (it starts over)."""
    return saved_in_checkpoints(name) and name != LOSS_AVERAGE
