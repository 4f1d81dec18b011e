"""The ranks other than 0 of a data-aware convert (``quantize.distributed``): each waits for what
rank 0's layer pass sends it and computes its share, and rank 0 writes everything.

- ``("pass", job)``: a GPTQ pass, run here on this rank's calibration samples (``runner.rank_pass``):
  every layer's captures on its own samples, the Linear units' Hessians sent to rank 0, its
  contiguous range of each layer's routed experts (``streamed._split_experts``);
- ``("autoround", job)``: an AutoRound layer, built here from the source (a MoE layer's dense part,
  and this rank's routed experts read and trained here), then each of its steps' contiguous share
  of the batch (``tuning.tune_rank``), until rank 0 says ``end``;
- ``("act_scales", job)``: SGLang's w4afp8 static input scales: this rank's share of the samples
  streamed through every layer, each expert's input maxima and token counts sent to rank 0;
- ``("done", result)``: rank 0's pass is over; its result is this rank's too.

What comes back is combined on rank 0 in rank order, which is item order (experts, samples): the
same additions as one process, so the same bytes for any number of ranks on the CPU (on GPUs: the same
bytes every run for a given world size; docs/distributed.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.output import RankScratch
from ..distributed import follow
from .tuning import tune_rank
from .forward import deterministic
from .runner import HIDDEN_DIR, _build, open_streamer, rank_pass


def serve(src: Path, world):
    """This rank's part of the run, until rank 0 is done: returns rank 0's result."""
    streamer = open_streamer(src)  # rank 0 validated the source and the layers before the first job
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as rank 0's pass: one torch thread per op, samples side by side
    def autoround(job):
        device = world.device if str(job["options"].device).startswith("cuda") else "cpu"
        # --init gptq: rank 0's captures beyond the memory budget spill to this rank's scratch folder
        scratch = RankScratch(Path(job["out"]), world.rank) if job.get("out") else None
        try:
            with deterministic(device):  # as rank 0's pass: the same bytes every run on the same GPUs
                tune_rank(world, streamer, _build(streamer, job["layer"], stream_experts=job["stream"]).to(device),
                          job, device, scratch.scratch(HIDDEN_DIR) if scratch is not None else None)
        finally:
            if scratch is not None:
                scratch.close()

    def act_scales(job):  # SGLang's w4afp8: this rank's samples through the layers, maxima to rank 0
        from ..calibrate.act_scales import observe

        streamer.device = job["device"] if job["device"] == "cpu" or world.backend != "nccl" else world.device
        streamer.expert_budget = job["budget"]
        observe(streamer, job["ids"], world)

    try:
        return follow(world, {"pass": lambda job: rank_pass(src, job, world), "autoround": autoround,
                              "act_scales": act_scales})
    finally:
        torch.set_num_threads(old)
        streamer.close()
