"""A job of four ranks on gloo with Megatron's kind of process groups (tensor-parallel pairs
[0, 1] and [2, 3], data-parallel pairs [0, 2] and [1, 3], created on every rank in one order),
Flight Recorder on, where one rank stops before a collective: its tensor-parallel peer waits for
it, and so does its data-parallel peer; the third waiting rank waits on the second, a victim.

    TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=DIR/nccl_trace_rank_ \\
        torchrun --standalone --nproc_per_node 4 tests/helpers/hang_job.py --hang 3

Each rank dumps its trace when its collective times out, and the hung one when torchrun stops it
(infra.local_job.flight_recorder, as the local job does)."""

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from infra.local_job import flight_recorder  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hang", type=int, required=True, help="the rank that stops")
    p.add_argument("--at", type=int, default=3, help="the step it stops at")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    flight_recorder.start()
    rank = dist.get_rank()
    groups = {}
    for kind, sets in (
        ("TENSOR_MODEL_PARALLEL_GROUP", ([0, 1], [2, 3])),
        ("DATA_PARALLEL_GROUP", ([0, 2], [1, 3])),
    ):
        for ranks in sets:
            group = dist.new_group(ranks, timeout=TIMEOUT, group_desc=kind)
            if rank in ranks:
                groups[kind] = group
    t = torch.ones(8)
    try:
        for step in range(1, 6):
            if rank == args.hang and step == args.at:
                while True:  # stuck outside any collective: a hung kernel, a data loader
                    time.sleep(60)
            dist.all_reduce(t, group=groups["TENSOR_MODEL_PARALLEL_GROUP"])
            dist.all_reduce(t, group=groups["DATA_PARALLEL_GROUP"])
            print(f"rank {rank} step {step}", flush=True)
    except BaseException:
        flight_recorder.dump()
        raise


if __name__ == "__main__":
    main()
